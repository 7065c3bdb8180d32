"""The in-house rollout engine: continuous batching of a call's samples over a paged KV cache.

  paged   PagedEngine, the `rollout.RolloutEngine` the trainer and evaluation hold
  call    one call from the host: decode copy, run_call, generate
  queue   RequestQueue: many prompts, calls of one bucket each (evaluation)
  loop    the jitted program: EngineState, the while loop, engine_fn
  paging  PagePool, the free-page stack, the model's paged cache modes
  shapes  RowLayout, CallShape (the one pool rule), EngineStats
"""
