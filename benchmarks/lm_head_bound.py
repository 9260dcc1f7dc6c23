"""Could a greedy step read the LM head in bfloat16 and still pick float32's token? Candidates per row.

    .venv/bin/python benchmarks/lm_head_bound.py [--requests 32] [--tokens 24]

The LM head is the decode step's largest read (49 of the demo model's 87 MB of multiplied
weights) and a greedy step keeps only each row's argmax. With the head's weights w rounded to
bfloat16 (w~), each logit computed from them differs from float32's by at most

    e_v = c * ||h||_2 * ||w_v||_2,   c = u_w + u_h + u_w u_h + 2 gamma_K (1 + u_w) (1 + u_h),

(c times 1.01: `contbatch.engine.argmax_head.bound_for`; u = 2^-8 for a bfloat16 operand, 0 for
a float32 one; gamma_K = K 2^-24 / (1 - K 2^-24) for the float32 sums of K products, both
sides; Cauchy-Schwarz for sum |h_k| |w_vk|). A column whose approximate logit plus its bound is
below the largest, over the row's columns, of approximate logit minus bound cannot be float32's
argmax; the others (the candidates), summed again in float32 as the kernel sums, give float32's
argmax exactly. `contbatch.engine.argmax_head` does this with both variants below, one for each
of its kernels; what it sums again is the candidates per row, measured here on the demo model's
real hidden states: the engine decodes --requests prompts for --tokens tokens each (greedy, past
any end of sequence), and every row that reaches the LM head is taken (its final-normalised
hidden state h). Two variants: w in bfloat16 and h in float32 (the "vectors" kernel: AVX-512's
float32 multiply-adds), and both in bfloat16 (the "tiles" kernel: AMX's tdpbf16ps, sixteen
rows by sixteen columns by thirty-two k an instruction). Also printed: the largest measured error
as a share of the bound (the bound must never be exceeded). Prints a table, writes JSON
(--json-out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = (
    "The quick brown fox jumps over the lazy dog and then",
    "Once upon a time, in a land far away, there lived",
    "def fibonacci(n):\n    if n <",
    "In 1969 the first humans walked on",
    "The capital of France is",
    "A list of prime numbers: 2, 3, 5, 7,",
)


def hidden_states(requests: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The final-normalised hidden states of every row the demo model's greedy decode sent to its LM
    head, and the head's float32 weights [vocab, hidden]."""
    from contbatch.engine.llm_engine import EngineConfig, LLMEngine
    from contbatch.loop.params import SamplingParams

    engine = LLMEngine(EngineConfig(kv_cache_memory=256 * 1024**2))
    model = engine.runner.model
    captured: list[torch.Tensor] = []
    logits = model._logits

    def capture(h: torch.Tensor, greedy_out: torch.Tensor | None = None) -> torch.Tensor:
        captured.append(h.detach().clone())
        return logits(h, greedy_out)

    model._logits = capture  # type: ignore[method-assign]
    model.argmax_head = None  # (every row through `_logits`: the same hidden states)
    for i in range(requests):
        engine.add_request(
            PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()
    from contbatch.engine.loader import load_weights

    weights = load_weights(engine.model_path, model.spec)
    head = weights["model.embed_tokens.weight" if model.spec.tie_word_embeddings else "lm_head.weight"]
    return torch.cat(captured).float(), head.float()


def candidates(h: torch.Tensor, w: torch.Tensor, *, bf16_h: bool) -> dict[str, Any]:
    """Candidates per row with the head in bfloat16 (and h too, with `bf16_h`)."""
    from contbatch.engine.argmax_head import bound_for

    c = bound_for(w.shape[1], rounded_operands=2 if bf16_h else 1)
    approx_h = h.bfloat16().float() if bf16_h else h
    exact = h.double() @ w.double().T  # the real sums, for the measured error
    approx = approx_h @ w.bfloat16().float().T
    f32 = h @ w.T
    bound = c * h.norm(dim=1, keepdim=True) * w.norm(dim=1)[None, :]
    error = torch.maximum((approx.double() - exact).abs(), (f32.double() - exact).abs()).max().item()
    measured = ((approx - f32).abs() / bound).max().item()
    floor = (approx - bound).max(dim=1, keepdim=True).values
    count = (approx + bound >= floor).sum(dim=1).float()
    picked_right = bool((torch.where(approx + bound >= floor, f32, float("-inf")).argmax(1) == f32.argmax(1)).all())
    return {
        "c": c,
        "rows": h.shape[0],
        "candidates_median": count.median().item(),
        "candidates_mean": count.mean().item(),
        "candidates_max": count.max().item(),
        "error_over_bound_max": measured,
        "largest_abs_error": error,
        "argmax_among_candidates_is_float32s": picked_right,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--json-out", type=Path, default=ROOT / "benchmarks" / "results" / "lm_head_bound.json")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.tokens < 1:
        parser.error("--requests and --tokens must be positive")
    torch.set_num_threads(2)
    h, w = hidden_states(args.requests, args.tokens)
    rows = {"w bf16, h f32": candidates(h, w, bf16_h=False), "w bf16, h bf16": candidates(h, w, bf16_h=True)}
    print(f"{h.shape[0]} rows, LM head {w.shape[0]} x {w.shape[1]}")
    head = ("variant", "c", "cand. median", "mean", "max", "error/bound", "exact")
    print(f"{head[0]:16s} {head[1]:>9s} {head[2]:>13s} {head[3]:>6s} {head[4]:>5s} {head[5]:>12s} {head[6]:>6s}")
    for name, r in rows.items():
        exact = r["argmax_among_candidates_is_float32s"]
        print(
            f"{name:16s} {r['c']:9.5f} {r['candidates_median']:13.0f} {r['candidates_mean']:6.2f}"
            f" {r['candidates_max']:5.0f} {r['error_over_bound_max']:12.3f} {exact!s:>6s}"
        )
    doc = {"args": vars(args) | {"json_out": str(args.json_out)}, "variants": rows}
    args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
