"""OpenAI-compatible serving: request validation (protocol), the step-interleaving scheduler (with
the drift fallback monitor of decode/fallback.py), Prometheus metrics, the FastAPI app, and drafter
export for vLLM/SGLang.

Needs the `serve` extra (fastapi, uvicorn, prometheus-client); the core package does not.
"""
