"""Convergence: a tiny GPT trained with NVFP4 linears ends within 5% of the same model in BF16 (CPU).

The GPU version (tests_multigpu/gpt_convergence.py: 6 layers, hidden 512, 8 heads, 300 steps) holds 2%.
"""
from gpt_model import GPTConfig, final_loss, train

TINY = GPTConfig(num_layers=1, hidden_size=32, num_heads=2, seq_length=32, vocab_size=32)
STEPS, BATCH, LR = 40, 2, 1e-2
BOUND = 0.05


def test_nvfp4_tiny_gpt_converges_like_bf16():
    bf16 = train(TINY, bf16=True, steps=STEPS, batch_size=BATCH, lr=LR)
    nvfp4 = train(TINY, bf16=False, steps=STEPS, batch_size=BATCH, lr=LR)
    assert bf16[0] - final_loss(bf16) > 1.0, "the baseline must learn for the comparison to mean anything"
    gap = abs(final_loss(nvfp4) - final_loss(bf16)) / final_loss(bf16)
    assert gap <= BOUND, f"NVFP4 final loss {final_loss(nvfp4):.4f} vs BF16 {final_loss(bf16):.4f} ({gap:.1%})"
