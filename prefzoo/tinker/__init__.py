"""The Tinker training API (issue 50). Direction A: prefzoo serves it (``prefzoo serve --api tinker``):

    server.py   the FastAPI app the ``tinker`` SDK talks to: sessions, futures, the worker, checkpoints
    host.py     the models: one base model, a peft LoRA adapter and an AdamW per client; prefzoo's hf sampler
    losses.py   the SDK's losses (cross_entropy, importance_sampling, ppo, cispo, dro) on prefzoo's objective functions
    wire.py     the SDK's protobuf bodies (forward_backward request, its output, the sample response)
    local.py    build a server on a model and run it (the command line's path; in a thread for tests)

Direction B: prefzoo's plugins train through any Tinker server (``backend=tinker``):

    backend.py  the client side: the policy a plugin sees (the server's log-probs as a leaf tensor, its sampler, its
                base model as pi_ref), the optimizer the loop steps (weights = -dL/dlogp, then Adam there), the
                server's states as the run's checkpoints; the pre-flight's server check

docs/tinker.md is the user's page. Room rule (tests/test_architecture.py): this room imports the base and the middle
of the house (models, rollout, objective, types, ...), never the plugins or the loop.
"""
