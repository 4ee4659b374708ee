"""The engine core: its loop and process, scheduler, step-plan builder, stopping, warm-up (imports cache, drives worker)."""
