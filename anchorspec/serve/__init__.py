"""OpenAI-compatible serving: request validation (protocol), the step-interleaving scheduler,
the drift fallback monitor, Prometheus metrics, the FastAPI app, and drafter export for vLLM/SGLang.

Needs the `serve` extra (fastapi, uvicorn, prometheus-client); the core package does not.
"""
