"""A small single-device GPT for the NVFP4-vs-BF16 convergence checks (tests/ and tests_multigpu/).

The four linears of each block are nvfp4_dist.Linear (NVFP4, or its BF16 fallback for the baseline);
embeddings, norms, attention math and the output head stay in BF16/FP32 (docs/numerics.md §10). Parameters are FP32
master weights; activations run in BF16. The token stream is a fixed Markov chain (each token has 4
likely successors: the loss floor is ln 4).
"""
import dataclasses

import torch
import torch.nn.functional as F

from nvfp4_dist.linear import Linear
from nvfp4_dist.recipe import NVFP4Recipe


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    num_layers: int = 6
    hidden_size: int = 512
    num_heads: int = 8
    seq_length: int = 256
    vocab_size: int = 512


class Block(torch.nn.Module):
    def __init__(self, config: GPTConfig, bf16: bool, recipe: NVFP4Recipe | None, device):
        super().__init__()
        h = config.hidden_size
        linear = dict(bf16_fallback=bf16, recipe=recipe, device=device)
        self.num_heads = config.num_heads
        self.norm1 = torch.nn.LayerNorm(h, device=device)
        self.qkv = Linear(h, 3 * h, **linear)
        self.proj = Linear(h, h, **linear)
        self.norm2 = torch.nn.LayerNorm(h, device=device)
        self.fc1 = Linear(h, 4 * h, **linear)
        self.fc2 = Linear(4 * h, h, **linear)

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(norm(self.norm1, x)).split(hidden, dim=-1)
        heads = [t.reshape(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v)]
        attention = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc2(F.gelu(self.fc1(norm(self.norm2, x))))


def norm(layer_norm, x):
    """LayerNorm in FP32, back to the activation dtype."""
    return layer_norm(x.float()).to(x.dtype)


class GPT(torch.nn.Module):
    """bf16=True: every linear in its BF16 fallback (the baseline). bf16_first/last: per-layer fallback."""

    def __init__(self, config: GPTConfig, *, bf16: bool = False, recipe: NVFP4Recipe | None = None, device=None):
        super().__init__()
        recipe = recipe or NVFP4Recipe()
        self.embedding = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        self.position = torch.nn.Embedding(config.seq_length, config.hidden_size, device=device)
        self.blocks = torch.nn.ModuleList(
            Block(config, bf16 or recipe.is_bf16_layer(i, config.num_layers), recipe, device)
            for i in range(config.num_layers))
        self.norm = torch.nn.LayerNorm(config.hidden_size, device=device)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = (self.embedding(tokens) + self.position(positions)).to(torch.bfloat16)
        for block in self.blocks:
            x = block(x)
        return F.linear(norm(self.norm, x), self.head.weight.to(torch.bfloat16)).float()


def markov_token_stream(num_tokens: int, vocab_size: int, seed: int = 1234) -> torch.Tensor:
    """A fixed Markov chain: every token is followed by one of its 4 successors, uniformly."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=generator)
    choices = torch.randint(0, 4, (num_tokens,), generator=generator).tolist()
    table = successors.tolist()
    tokens = [int(torch.randint(0, vocab_size, (1,), generator=generator))]
    for choice in choices[1:]:
        tokens.append(table[tokens[-1]][choice])
    return torch.tensor(tokens, dtype=torch.long)


def train(config: GPTConfig, *, bf16: bool, steps: int, batch_size: int, lr: float, device="cpu", seed: int = 0,
          recipe: NVFP4Recipe | None = None, log_every: int = 0, label: str | None = None) -> list[float]:
    """Train from a fixed init on a fixed stream; returns the per-step losses. recipe: the NVFP4 linears' (None: the
    defaults); label: the name in the log lines (default bf16 or nvfp4)."""
    torch.manual_seed(seed)
    model = GPT(config, bf16=bf16, recipe=recipe, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    tokens_per_step = batch_size * (config.seq_length + 1)
    stream = markov_token_stream(steps * tokens_per_step, config.vocab_size).to(device)
    losses = []
    for step in range(steps):
        batch = stream[step * tokens_per_step:(step + 1) * tokens_per_step].reshape(batch_size, -1)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"{label or ('bf16' if bf16 else 'nvfp4')} step {step:4d} loss {losses[-1]:.4f}", flush=True)
    return losses


def final_loss(losses: list[float], window: int = 10) -> float:
    """Mean of the last `window` losses (less noisy than the last one)."""
    tail = losses[-window:]
    return sum(tail) / len(tail)
