"""Convergence: a tiny GPT trained with NVFP4 linears follows the same model in BF16 step by step (CPU).

The GPU version (tests_multigpu/gpt_convergence.py: 6 layers, hidden 512, 8 heads, 250 steps) holds 2% on the final
loss.
"""
import math

from tests.helpers.gpt_model import GPTConfig, final_loss, train

TINY = GPTConfig(num_layers=1, hidden_size=32, num_heads=2, seq_length=32, vocab_size=32)
STEPS, BATCH, LR = 40, 2, 1e-2
FINAL_LOSS_GAP = 0.02
# The RMS over the steps of |loss_nvfp4 - loss_bf16| / loss_bf16. At this size the final losses alone cannot tell
# correct NVFP4 from a coarser grid, the trajectory can: correct NVFP4 sits at 0.40% (0.40-0.43% over seeds 0-2),
# every block scale one binade too large (2 x s_b) at 0.61% (0.52-0.63%).
TRAJECTORY_RMS = 0.005


def test_nvfp4_tiny_gpt_converges_like_bf16():
    bf16 = train(TINY, bf16=True, steps=STEPS, batch_size=BATCH, lr=LR)
    nvfp4 = train(TINY, bf16=False, steps=STEPS, batch_size=BATCH, lr=LR)
    assert bf16[0] - final_loss(bf16) > 1.0, "the baseline must learn for the comparison to mean anything"
    gap = abs(final_loss(nvfp4) - final_loss(bf16)) / final_loss(bf16)
    assert gap <= FINAL_LOSS_GAP, f"NVFP4 final loss {final_loss(nvfp4):.4f} vs BF16 {final_loss(bf16):.4f} ({gap:.1%})"
    rms = math.sqrt(sum(((n - b) / b) ** 2 for n, b in zip(nvfp4, bf16)) / STEPS)
    assert rms <= TRAJECTORY_RMS, f"NVFP4 loss trajectory {rms:.3%} (RMS relative) from BF16's"
