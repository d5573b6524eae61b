"""Training/evaluation data: dataset readers and chat rendering with an assistant-only loss mask."""

from anchorspec.data.chat import DROP, KEEP, System, assistant_spans, render_with_loss_mask, vary_system, with_system
from anchorspec.data.readers import (ReadStats, read_messages_jsonl, read_prompts, read_sharegpt,
                                     read_turns_jsonl)

__all__ = ["DROP", "KEEP", "System", "ReadStats", "assistant_spans", "read_messages_jsonl", "read_prompts",
           "read_sharegpt", "read_turns_jsonl", "render_with_loss_mask", "vary_system", "with_system"]
