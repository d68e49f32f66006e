"""One handoff: the prefill side's sends, the decode side's schedules, the payload format, the cache
checks, and generation on a handed-off cache."""
