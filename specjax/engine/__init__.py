"""The engine: a call's inputs (`batching`), the speculation plan (`plan`), the compiled loops
(`loop`, `adaptive.loop`) and the host API (`decoding`: `generate`, `speculative_generate`,
`Generation`), which is the package's public face."""

from specjax.engine.decoding import Generation, generate, speculative_generate

__all__ = ["Generation", "generate", "speculative_generate"]
