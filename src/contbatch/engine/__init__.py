"""The real PyTorch engine: a local Hugging Face checkpoint run by the project's own model code.

Modules: `spec`/`loader` (config.json + safetensors -> `ModelSpec` + weights), `model` (the
Llama-family decoder), `kv_cache` (paged KV + host swap), `attention` (paged attention over a
flat batch), `sampling`, `tokenizer`/`detokenizer`/`chat_template`, `demo` (the built-in random
demo model), `runner` (`ModelRunner.execute(SchedulerOutput) -> StepResult`).

Layering: imports `contbatch.core`, torch, tokenizers, safetensors, jinja2, numpy; never
`contbatch.sim`, asyncio or a web framework.
"""

from contbatch.engine.serving import make_server_backend

__all__ = ["make_server_backend"]
