"""nvfp4-train --fsdp on CPU (gloo processes): FSDP2 over the data-parallel replicas, the NVFP4 linears' weights
all-gathered in NVFP4, against the same job's replicated data parallelism; checkpoints of the shards resume exactly.

Why the losses are equal bit for bit: the NVFP4 gather gives each layer the bytes of quantizing the whole weight
(tests/test_fsdp_nvfp4.py), the other parameters are gathered in their own dtype (FP32), and at DP=2 the gradient
average is the same number either way (a + b of two replicas, halved: a power of two, exact); AdamW is
elementwise, so shards update as the whole tensors do. The gradient norm alone is summed in another order (per
shard, then across the replicas): equal to a few ulps, so a clipped step may differ in the last bits.
"""
import torch

from nvfp4_dist.launch import checkpoint
from tests.test_train_job import metrics, run_train

COMMON = ("--warmup-steps", "2", "--save-every", "0")


def losses_and_norms(out_dir):
    records = metrics(out_dir)
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def test_fsdp_trains_as_replicated_data_parallelism(tmp_path):
    """DP=2 (--dp 2 --tp 1: two processes): without clipping the gradients, the FSDP job's losses equal the
    replicated job's bit for bit; the norm it reports matches to float32 rounding."""
    runs = {}
    for name, flags in (("replicated", ()), ("fsdp", ("--fsdp",))):
        result = run_train(tmp_path / name, "--dp", "2", "--tp", "1", "--steps", "3", "--grad-clip", "0",
                           *COMMON, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = losses_and_norms(tmp_path / name)
    assert "(TP=1, DP=2 FSDP2, " in (tmp_path / "fsdp" / "train.log").read_text()
    assert "(TP=1, DP=2, " in (tmp_path / "replicated" / "train.log").read_text()
    (fsdp_losses, fsdp_norms), (losses, norms) = runs["fsdp"], runs["replicated"]
    assert fsdp_losses == losses, (fsdp_losses, losses)
    assert losses[-1] < losses[0] - 0.2, losses
    for got, expected in zip(fsdp_norms, norms):
        assert abs(got - expected) <= 1e-6 * expected, (fsdp_norms, norms)


def test_fsdp_with_tensor_and_sequence_parallelism_trains_as_replicated(tmp_path):
    """TP=2 x DP=2 with sequence parallelism and gradient clipping (four processes): the first step's loss is the
    replicated job's bit for bit (no update yet); later ones within 1e-5, the clip factor's last bits (module
    docstring), which no NVFP4 rounding turned into more on this run."""
    runs = {}
    for name, flags in (("replicated", ()), ("fsdp", ("--fsdp",))):
        result = run_train(tmp_path / name, "--tp", "2", "--dp", "2", "--sp", "--layers", "1", "--steps", "3",
                           *COMMON, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = losses_and_norms(tmp_path / name)
    assert "(TP=2, DP=2 FSDP2, SP on, " in (tmp_path / "fsdp" / "train.log").read_text()
    (fsdp_losses, fsdp_norms), (losses, norms) = runs["fsdp"], runs["replicated"]
    assert fsdp_losses[0] == losses[0]
    assert all(abs(got - expected) <= 1e-5 for got, expected in zip(fsdp_losses, losses)), (fsdp_losses, losses)
    assert all(abs(got - expected) <= 1e-5 * expected for got, expected in zip(fsdp_norms, norms))
    assert losses[-1] < losses[0] - 0.1, losses


def test_fsdp_checkpoint_holds_shards_and_resumes_exactly(tmp_path):
    """DP=2: 3 steps in one go, and 2 steps then resumed to 3 (the warm-up's learning rates do not depend on
    --steps), give the same losses bit for bit; each rank's file holds its shards as plain tensors; the checkpoint
    does not resume the replicated job (its tensors are whole), and the refusal names the flag."""
    flags = ("--dp", "2", "--tp", "1", "--fsdp", "--warmup-steps", "2")
    whole = run_train(tmp_path / "whole", *flags, "--steps", "3", "--save-every", "0")
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_train(tmp_path / "split", *flags, "--steps", "2", "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    state = torch.load(checkpoint.rank_file(tmp_path / "split" / "checkpoints", 2, 1), weights_only=True)
    assert state["config"]["fsdp"] is True
    fc1 = state["model"]["layers.0.fc1.weight"]  # [ffn 256 / DP 2, hidden 64]
    assert type(fc1) is torch.Tensor and fc1.shape == (128, 64)
    assert state["model"]["token_embedding.weight"].shape == (128, 64)
    moments = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    assert moments and all(type(m) is torch.Tensor for m in moments)
    assert any(m.shape == (128, 64) for m in moments)
    resumed = run_train(tmp_path / "split", *flags, "--steps", "3", "--save-every", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the step-2 checkpoint" in resumed.stdout
    expected = losses_and_norms(tmp_path / "whole")
    assert losses_and_norms(tmp_path / "split") == expected
    assert expected[0][-1] < expected[0][0] - 0.2
    refused = run_train(tmp_path / "split", "--dp", "2", "--tp", "1", "--steps", "5")
    assert refused.returncode == 2
    assert "--fsdp: checkpoint True, now False" in refused.stdout + refused.stderr


def test_a_skipped_step_under_fsdp_leaves_training_as_replicated(tmp_path):
    """--on-nonfinite skip with a NaN injected into the first layer's input at step 2: the forward stops inside
    an FSDP2-gathered layer, the step is skipped on every rank, and the next steps' losses are the replicated
    job's bit for bit (no update was made, so the weights a layer still holds gathered are current)."""
    runs = {}
    for name, flags in (("replicated", ()), ("fsdp", ("--fsdp",))):
        result = run_train(tmp_path / name, "--dp", "2", "--tp", "1", "--steps", "4", "--grad-clip", "0",
                           "--inject-fault", "nan:2", "--on-nonfinite", "skip", *COMMON, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = [(r["step"], r["loss"]) for r in metrics(tmp_path / name)]
    assert runs["fsdp"][1] == (2, None), runs["fsdp"]
    assert runs["fsdp"] == runs["replicated"]
