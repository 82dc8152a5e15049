"""The documentation holds together: docs/performance.md and the rendered block of docs/slow_links.md are what
benchmarks/render_performance.py renders from benchmarks/results/, and every relative link and every repository path
that README.md and docs/*.md cite exists."""
import ast
import copy
import json
import os
import pathlib
import re
import shlex
import sys

import pytest

from tests.helpers.benchmarks import load_benchmark_module

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
PAGES = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
# Top-level entries of the repository: an inline-code path starting with one of them is a path in this repository.
REPOSITORY_TOP = sorted(entry.name for entry in REPOSITORY.iterdir() if not entry.name.startswith(".git"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


render_performance = load_benchmark_module("render_performance")


def prose(page: pathlib.Path) -> str:
    """The page without its fenced code blocks (commands there name files of the reader's own machine)."""
    return FENCE.sub("", page.read_text())


def test_performance_page_is_rendered_from_the_results():
    expected = render_performance.render(render_performance.load_results())
    assert render_performance.OUTPUT.read_text() == expected, \
        "docs/performance.md is out of date: run python benchmarks/render_performance.py"


def test_check_flag_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "performance.md"
    stale.write_text(render_performance.render(render_performance.load_results()) + "\nedited by hand\n")
    monkeypatch.setattr(render_performance, "OUTPUT", stale)
    monkeypatch.setattr(render_performance, "REPOSITORY", tmp_path)
    current_block = tmp_path / "slow_links.md"
    current_block.write_text(render_performance.SLOW_LINKS.read_text())
    monkeypatch.setattr(render_performance, "SLOW_LINKS", current_block)
    assert render_performance.main(["--check"]) == 1
    assert capsys.readouterr().err.strip() == ("performance.md is out of date: run python "
                                               "benchmarks/render_performance.py")


def test_slow_links_block_is_rendered_from_the_results():
    page = render_performance.SLOW_LINKS.read_text()
    expected = render_performance.with_rendered_block(
        page, render_performance.slow_links_block(render_performance.load_results()), "slow_links.md")
    assert page == expected, \
        "docs/slow_links.md's rendered block is out of date: run python benchmarks/render_performance.py"


def test_check_flag_fails_on_a_stale_slow_links_block(tmp_path, monkeypatch, capsys):
    page = render_performance.SLOW_LINKS.read_text()
    stale = tmp_path / "docs" / "slow_links.md"
    stale.parent.mkdir()
    stale.write_text(page.replace(render_performance.BLOCK_END,
                                  "| a row edited by hand |\n" + render_performance.BLOCK_END))
    monkeypatch.setattr(render_performance, "SLOW_LINKS", stale)
    monkeypatch.setattr(render_performance, "OUTPUT", tmp_path / "docs" / "performance.md")
    monkeypatch.setattr(render_performance, "REPOSITORY", tmp_path)
    render_performance.OUTPUT.write_text(render_performance.render(render_performance.load_results()))
    assert render_performance.main(["--check"]) == 1
    assert capsys.readouterr().err.strip() == (f"{pathlib.Path('docs', 'slow_links.md')} is out of date: run python "
                                               f"benchmarks/render_performance.py")
    assert render_performance.main([]) == 0 and "a row edited by hand" not in stale.read_text()
    assert render_performance.main(["--check"]) == 0
    assert stale.read_text().count(render_performance.BLOCK_BEGIN) == 1


def test_a_page_without_its_block_markers_is_refused():
    block = ["rendered"]
    begin, end = render_performance.BLOCK_BEGIN, render_performance.BLOCK_END
    for page in ("text only\n", f"{end}\n{begin}\n", f"{begin}\n{begin}\n{end}\n"):
        with pytest.raises(ValueError, match="slow_links.md: "):
            render_performance.with_rendered_block(page, block, "slow_links.md")
    page = f"before\n{begin}\nold\n{end}\nafter"
    assert render_performance.with_rendered_block(page, block, "slow_links.md") == \
        f"before\n{begin}\nrendered\n{end}\nafter\n"


def test_slow_links_rows_show_each_path_and_link_class(tmp_path):
    """The gains block's rows, from an overlap and a Megatron result whose times are set by hand."""
    record = json.loads((render_performance.RESULTS / "overlap_h100_tp4_slow.json").read_text())
    (shape,) = record["shapes"]
    shape["auto_path"] = "collectives"
    shape["fwd+bwd"].update(comm=30.04, no_comm=20.0, plain=40.0, speedup=1.25, split_speedup=1.6, auto_speedup=1.5)
    record["shapes"] = [shape, dict(shape, tokens=4096, auto_path="plain", **{"fwd+bwd": dict(shape["fwd+bwd"])})]
    del record["shapes"][1]["fwd+bwd"]["split_speedup"]  # a result that did not measure split collectives
    (tmp_path / "overlap_h100_tp4_slow.json").write_text(json.dumps(record))
    _copy_result("overlap_h100_tp4_slow.json", tmp_path, "overlap_h100_tp4_two-node.json", links="two-node",
                 torchrun_nodes=2)
    gpt = _copy_result("megatron_gpt_h100x2_slow.json", tmp_path, "megatron_gpt_h100x2_slow.json",
                       tokens_per_s_ratio=1.5, collectives_tokens_per_s_ratio=1.25, auto_tokens_per_s_ratio=1.75)
    gpt["results"]["local_bf16"]["step_ms"], gpt["results"]["nvfp4"]["step_ms"] = 900.0, 600.0
    (tmp_path / "megatron_gpt_h100x2_slow.json").write_text(json.dumps(gpt))
    block = render_performance.slow_links_block(render_performance.load_results(tmp_path))
    rows = [line for line in block if line.startswith("| 4 x") or line.startswith("| 2 x")]
    assert len(rows) == 4
    provenance = "<br>2026-11-27, commit 3557b04, torch 2.11.0+cu130 |"
    assert rows[0] == ("| 4 x NVIDIA H100 80GB HBM3 | slow | 16384, 8192, 28672 | 30.0 ms | 20.0 ms | 40.0 ms | "
                       "1.25x | 1.60x | 1.50x (split collectives) | [overlap_h100_tp4_slow.json]"
                       "(../benchmarks/results/overlap_h100_tp4_slow.json)" + provenance), rows[0]
    assert rows[1].startswith("| 4 x NVIDIA H100 80GB HBM3 | slow | 4096, 8192, 28672 | 30.0 ms | 20.0 ms | "
                              "40.0 ms | 1.25x | not measured | 1.50x (plain) |"), rows[1]
    assert rows[2].startswith("| 4 x NVIDIA H100 80GB HBM3 | two-node (2 nodes) | 16384,"), rows[2]
    assert rows[3] == ("| 2 x NVIDIA H100 80GB HBM3 | slow | 4 layers, hidden 8192, seq 4096, micro-batch 8 | "
                       "900.0 ms | 600.0 ms (auto) | 1.50x | collectives 1.25x, auto 1.75x | "
                       "[megatron_gpt_h100x2_slow.json]"
                       "(../benchmarks/results/megatron_gpt_h100x2_slow.json)<br>2026-11-27, commit bf97e04 |"), rows[3]


def test_every_result_is_a_row_naming_its_command():
    results = render_performance.load_results()
    assert results
    page = render_performance.OUTPUT.read_text()
    for result in results:
        row = next(line for line in page.splitlines() if f"[{result.path.name}]" in line)
        if result.benchmark in render_performance.CONVERGENCE:  # a line above the table: Command: `...`; JSON ...
            command = re.match(r"Command: `([^`]+)`; JSON ", row).group(1)
        else:
            command = row.split(" | ")[3].strip("`")
        assert command == result.command
        words = shlex.split(command)
        scripts = [word for word in words if word.endswith(".py")]
        scripts += [words[index + 1].replace(".", "/") + ".py" for index, word in enumerate(words[:-1]) if word == "-m"]
        assert scripts and (REPOSITORY / scripts[0]).is_file(), command
        start = next(index for index, word in enumerate(words) if word.endswith(".py") or word == "-m")
        assert {"python", "torchrun"} & set(words[:start]), command
        assert "--out" not in words


def _copy_result(source: str, directory: pathlib.Path, name: str, **changes) -> dict:
    record = json.loads((render_performance.RESULTS / source).read_text())
    record = copy.deepcopy(record) | changes
    (directory / name).write_text(json.dumps(record))
    return record


def test_two_results_for_one_row_are_refused(tmp_path):
    _copy_result("gemm_h200.json", tmp_path, "gemm_h200.json")
    _copy_result("gemm_h200.json", tmp_path, "gemm_h200_rerun.json")
    with pytest.raises(ValueError, match="gemm_h200.json and gemm_h200_rerun.json"):
        render_performance.load_results(tmp_path)


def test_a_variant_is_its_own_row(tmp_path):
    _copy_result("megatron_gpt_h200x4.json", tmp_path, "megatron_gpt_h200x4.json")
    _copy_result("megatron_gpt_h200x4.json", tmp_path, "megatron_gpt_h200x4_max_connections_1.json",
                 cuda_device_max_connections="1")
    page = render_performance.render(render_performance.load_results(tmp_path))
    rows = [line for line in page.splitlines() if line.startswith("| Megatron-Core GPT")]
    assert len(rows) == 2
    assert "(CUDA_DEVICE_MAX_CONNECTIONS=1)" in rows[1] and "`CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun" in rows[1]


def test_each_link_class_is_its_own_row(tmp_path):
    _copy_result("overlap_h200_tp4.json", tmp_path, "overlap_h200_tp4_nvlink.json", links="nvlink")
    for links in ("slow", "two-node"):
        _copy_result("overlap_h200_tp4.json", tmp_path, f"overlap_h200_tp4_{links}.json", links=links)
    page = render_performance.render(render_performance.load_results(tmp_path))
    rows = [line for line in page.splitlines() if line.startswith("| communication/GEMM overlap")]
    assert [row.split(" | ")[0] for row in rows] == ["| communication/GEMM overlap",
                                                      "| communication/GEMM overlap (links slow)",
                                                      "| communication/GEMM overlap (links two-node)"]


def test_the_b200_projection_shows_the_layer_chains_as_measured(tmp_path):
    """The measured row of a GPU: the layer's chains (2 norms + SwiGLU) per token, their speedup and their share of
    the copy bandwidth on the bytes they move, from rows whose times and bytes are set by hand."""
    record = json.loads((render_performance.RESULTS / "fused_producers_h100.json").read_text())
    per_token = {  # (producer, width, chain): (ns, bytes moved) per token
        ("RMSNorm", render_performance.PROJECTION_HIDDEN, "unfused"): (20, 40),
        ("RMSNorm", render_performance.PROJECTION_HIDDEN, "fused"): (10, 20),
        ("swiglu", render_performance.PROJECTION_FFN, "unfused"): (60, 120),
        ("swiglu", render_performance.PROJECTION_FFN, "fused"): (40, 80),
    }
    template = next(r for r in record["results"] if r["copies"] == render_performance.BOTH_COPIES)
    record["results"] = [
        dict(template, producer=producer, width=width, chain=chain, tokens=tokens, ms=ns * tokens * 1e-6,
             bytes_moved=moved * tokens, copy_gbps=2.0)
        for (producer, width, chain), (ns, moved) in per_token.items() for tokens in (1000, 4000)]
    (tmp_path / "fused_producers_h100.json").write_text(json.dumps(record))
    page = render_performance.render(render_performance.load_results(tmp_path))
    (row,) = [line for line in page.splitlines() if line.startswith(f"| {record['gpu']} | ")]
    # unfused 2 * 20 + 60 = 100 ns for 200 bytes at 2 GB/s: 100%; fused 2 * 10 + 40 = 60 ns for 120 bytes: 100%
    assert row == f"| {record['gpu']} | 2 GB/s | 100.0 ns | 60.0 ns | 1.67x | 100.0%, 100.0% |", row


def test_an_overlap_result_with_split_collectives_shows_them(tmp_path):
    record = json.loads((render_performance.RESULTS / "overlap_h100_tp4_slow.json").read_text())
    for shape in record["shapes"]:
        shape["auto_path"] = "collectives"
        for times in (shape["fwd"], shape["fwd+bwd"]):
            times.update(split_speedup=1.25, split_over_max_no_comm_comm=1.125, split=1.0, speedup=1.1,
                         overlapped_over_max_no_comm_comm=1.3, auto=12.0, auto_speedup=1.2, no_comm=8.0, comm=10.0)
    record["overlap_transport"] = "auto"
    (tmp_path / "overlap_h100_tp4_slow.json").write_text(json.dumps(record))
    page = render_performance.render(render_performance.load_results(tmp_path))
    (row,) = [line for line in page.splitlines() if line.startswith("| communication/GEMM overlap")]
    assert ("as overlap=True runs it (overlap_transport=auto: on split collectives)" in row
            and "every layer on split collectives 1.25x / 1.25x, split / max(no-comm, comm) 1.12 / 1.12" in row
            and "every layer on the ring 1.10x / 1.10x, ring / max(no-comm, comm) 1.30 / 1.30;" in row
            and "on split collectives) 1.20x / 1.20x, its step / max(no-comm, comm) 1.20 / 1.20;" in row), row


def test_a_recorded_command_is_shown_without_output_flags(tmp_path):
    _copy_result("allgather_h200_x4.json", tmp_path, "allgather_h200_x4.json",
                 command="NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 benchmarks/allgather.py --hidden 4096 "
                         "--out /results/allgather_h200_x4.json --out-dir=/results")
    (result,) = render_performance.load_results(tmp_path)
    assert result.command == "NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 benchmarks/allgather.py --hidden 4096"


def test_results_directory_keeps_the_pictures_the_page_links():
    page = render_performance.OUTPUT.read_text()
    for picture in render_performance.RESULTS.glob("*.png"):
        assert f"../benchmarks/results/{picture.name}" in page, f"{picture.name} is not linked from the page"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_relative_links_point_to_files(page):
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name} links {target}, which does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_cited_repository_paths_exist(page):
    for span in CODE_SPAN.findall(prose(page)):
        if " " in span or "/" not in span or span.split("/")[0] not in REPOSITORY_TOP:
            continue
        path = span.split("::")[0].rstrip("/")
        found = any(REPOSITORY.glob(path)) if any(c in path for c in "*?[") else (REPOSITORY / path).exists()
        assert found, f"{page.name} cites `{span}`, which is not in the repository"


def test_the_path_check_catches_a_wrong_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("The transport lives in `nvfp4_dist/parallel/symmetric.py`.\n")
    with pytest.raises(AssertionError, match="nvfp4_dist/parallel/symmetric.py"):
        test_cited_repository_paths_exist(page)


def test_numerics_has_every_section_the_code_cites():
    numerics = (REPOSITORY / "docs" / "numerics.md").read_text()
    headings = set(re.findall(r"^#+ §(\d+(?:\.\d+)?)\b", numerics, re.MULTILINE))
    cited = set()
    for path in [*REPOSITORY.glob("*/**/*.py"), *REPOSITORY.glob("csrc/*"), *PAGES]:
        if ".git" in path.parts or not path.is_file():
            continue
        for sections in re.findall(r"numerics\.md (§[\d.,\- §]+)", path.read_text(errors="replace")):
            cited.update(re.findall(r"§(\d+(?:\.\d+)?)", sections))
    missing = {section for section in cited if section not in headings and section.split(".")[0] not in headings}
    assert not missing, f"docs/numerics.md lacks the cited sections {sorted(missing)}"


def test_benchmarks_record_the_command_that_ran_them(monkeypatch):
    provenance = load_benchmark_module("provenance")
    for name in [name for name in os.environ if name.startswith(provenance.SETTING_PREFIXES)]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", [str(REPOSITORY / "benchmarks" / "overlap.py"), "--shapes", "16,32,64;32,64,128"])
    monkeypatch.setenv("NVFP4_COMMIT", "abc1234")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert provenance.command_line() == ("CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/overlap.py "
                                         "--shapes '16,32,64;32,64,128'")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert provenance.command_line().startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nnodes 2 --nproc-per-node 4 "
                                                "benchmarks/overlap.py ")
    for script in sorted((REPOSITORY / "benchmarks").glob("*.py")):
        text = script.read_text()
        if "commit=git_commit()" in text or "\"commit\": git_commit()" in text:
            assert "command=command_line()" in text or '"command": command_line()' in text, script.name


# Where each installed package's files are, and its layer (docs/architecture.md): lower layers never import higher.
PACKAGE_DIRECTORIES = {"nvfp4_dist": "nvfp4_dist", "nvfp4_dist.parallel": "parallel", "nvfp4_dist.launch": "launch"}
LAYERS = ("nvfp4_dist", "nvfp4_dist.parallel", "nvfp4_dist.launch")


def layer_of(module: str):
    """The index in LAYERS of the package that holds `module`, or None outside nvfp4_dist."""
    for index in reversed(range(len(LAYERS))):
        if module == LAYERS[index] or module.startswith(LAYERS[index] + "."):
            return index
    return None


def imported_modules(path: pathlib.Path, module: str):
    """(line, imported module or None for a relative import that climbs out of its folder) of every import."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.lineno, node.module
            elif node.level == 1:
                yield node.lineno, ".".join(filter(None, [package, node.module]))
            else:
                yield node.lineno, None


def test_imports_go_one_way():
    problems = []
    for package, directory in PACKAGE_DIRECTORIES.items():
        for path in sorted((REPOSITORY / directory).rglob("*.py")):
            parts = path.relative_to(REPOSITORY / directory).with_suffix("").parts
            module = ".".join([package, *parts[:-1], *([] if parts[-1] == "__init__" else [parts[-1]])])
            for line, imported in imported_modules(path, module):
                where = f"{path.relative_to(REPOSITORY)}:{line}"
                if imported is None:
                    problems.append(f"{where}: a relative import that climbs out of its folder")
                elif layer_of(imported) is not None and layer_of(imported) > layer_of(module):
                    problems.append(f"{where}: {module} imports {imported}, a higher layer")
    assert not problems, "\n".join(problems)


def test_a_result_of_an_unknown_benchmark_is_refused(tmp_path):
    _copy_result("gemm_h200.json", tmp_path, "attention_h200.json", benchmark="attention")
    with pytest.raises(ValueError, match="attention_h200.json: its benchmark is none of"):
        render_performance.load_results(tmp_path)


def _convergence_record(benchmark: str) -> dict:
    """A convergence JSON of three variants, in the drivers' format (tests_multigpu/convergence_variants.py)."""
    variants = {"bf16": dict(description="BF16", recipe=None, baseline=None, final_loss=2.0, gap_vs_bf16=None,
                             gap_vs_baseline=None),
                "nvfp4": dict(description="NVFP4, default recipe", recipe={}, baseline="bf16", final_loss=2.02,
                              gap_vs_bf16=0.01, gap_vs_baseline=0.01),
                "4over6_all": dict(description="4over6 on weights and activations, RHT off",
                                   recipe={"nvfp4_4over6": "all", "rht": False}, baseline="nvfp4_no_rht",
                                   final_loss=2.01, gap_vs_bf16=0.005, gap_vs_baseline=-0.0075)}
    for variant in variants.values():
        variant.update(first_loss=6.0, seconds=30.0, losses=[6.0, variant["final_loss"]])
    if benchmark == "gpt_convergence":
        return dict(benchmark=benchmark, config=dict(num_layers=6, hidden_size=512, num_heads=8, seq_length=256,
                                                     vocab_size=512), gpu="NVIDIA H100 80GB HBM3", steps=250,
                    batch_size=16, lr=1e-3, bound=0.02, gap=0.01, variants=variants, commit="abc1234",
                    date="2026-11-27")
    for variant in variants.values():
        variant["train_seconds"] = 12.5
    return dict(benchmark=benchmark, gpu="NVIDIA H100 80GB HBM3", gpus=1, tp=1, steps=200, seq=1024, micro_batch=4,
                seed=1234, layers=8, hidden=1024, heads=16, ffn=2816, vocab=32000, data="markov",
                data_entropy_rate=1.234, megatron_core="0.16.1", variants=variants, commit="abc1234",
                date="2026-11-27")


def test_convergence_tables_one_per_model_and_a_line_for_a_missing_one(tmp_path):
    (tmp_path / "megatron_convergence_h100.json").write_text(json.dumps(_convergence_record("megatron_convergence")))
    page = render_performance.render(render_performance.load_results(tmp_path))
    section = page[page.index("## Convergence"):]
    assert "No result in `benchmarks/results/` yet: `python -m tests_multigpu.gpt_convergence` on a GPU" in section
    assert "### Megatron-Core GPTModel of `tests_multigpu/megatron_train.py`, NVIDIA H100 80GB HBM3" in section
    assert ("Command: `python -m tests_multigpu.megatron_convergence --nproc 1 --steps 200 --seq 1024 --micro-batch 4 "
            "--seed 1234 --variants nvfp4 4over6_all`; JSON [megatron_convergence_h100.json]") in section
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == [
        "| bf16: BF16 | BF16 linears | 2.0000 |  |  |  | 30.0 (12.5) |",
        "| nvfp4: NVFP4, default recipe | defaults | 2.0200 | +1.00% | bf16 | +1.00% | 30.0 (12.5) |",
        "| 4over6_all: 4over6 on weights and activations, RHT off | `nvfp4_4over6=all`, `rht=False` | 2.0100 | "
        "+0.50% | nvfp4_no_rht | -0.75% | 30.0 (12.5) |"]
    (tmp_path / "gpt_convergence_h100.json").write_text(json.dumps(_convergence_record("gpt_convergence")))
    page = render_performance.render(render_performance.load_results(tmp_path))
    assert "No result" not in page and "## NVIDIA H100" not in page  # convergence results make no benchmark table
    assert ("Command: `python -m tests_multigpu.gpt_convergence --steps 250 --batch-size 16 --lr 0.001 --bound 0.02 "
            "--variants nvfp4 4over6_all`") in page


def test_a_megatron_result_with_other_transports_shows_them(tmp_path):
    record = json.loads((render_performance.RESULTS / "megatron_gpt_h100x2_slow.json").read_text())
    record["args"]["overlap_transports"] = ["collectives"]
    record["results"].pop("nvfp4_auto")
    record["collectives_tokens_per_s_ratio"] = 1.5
    record["results"]["nvfp4_collectives"]["step_ms"] = 700.04
    record["results"]["nvfp4"]["overlap_transport"] = "ring"
    record.pop("command")  # rebuilt from the arguments
    (tmp_path / "megatron_gpt_h100x2_slow.json").write_text(json.dumps(record))
    (result,) = render_performance.load_results(tmp_path)
    page = render_performance.render([result])
    (row,) = [line for line in page.splitlines() if line.startswith("| Megatron-Core GPT")]
    assert ("overlap transport: ring; on other transports, tokens/s vs BF16: collectives 1.50x (step 700.0 ms)"
            in row), row
    assert "--overlap-transports collectives" in result.command and "[" not in result.command, result.command
