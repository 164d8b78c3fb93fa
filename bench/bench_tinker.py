"""The Tinker server's HTTP overhead per training step (docs/tinker.md, "Measured").

    .venv/bin/python bench/bench_tinker.py                       # model=tiny, 8 datums x ~20 tokens
    .venv/bin/python bench/bench_tinker.py --model smollm2 --datums 16

A server (``prefzoo.tinker``) runs in a thread of this process on a free loopback port. A step is what a Tinker client
does: ``forward_backward(data, "cross_entropy")`` and ``optim_step`` submitted together, both awaited. The same work is
then called on the server's worker directly (``ModelHost.forward_backward`` + ``optim_step``, no HTTP, no protobuf, no
futures). The difference of the medians is the round trips' cost per step. Also timed: ``sample`` of 4 x 16 tokens
through the SDK.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny | smollm2 | a model folder")
    p.add_argument("--datums", type=int, default=8)
    p.add_argument("--steps", type=int, default=15, help="timed steps per variant (median reported)")
    args = p.parse_args()
    logging.getLogger("tinker").setLevel(logging.ERROR)

    import tinker
    import torch
    from tinker import types

    from prefzoo.models.loading import load_causal_lm, load_tokenizer
    from prefzoo.tinker.local import make_server, start_in_thread
    from prefzoo.tinker.losses import loss_config

    tmp = tempfile.mkdtemp()
    if args.model == "tiny":
        folder = os.path.join(tmp, "models", "tiny-h64-l2-s0")
        tokenizer = load_tokenizer("tiny")
        load_causal_lm("tiny", seed=0, tokenizer=tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    elif args.model == "smollm2":
        from prefzoo.models.loading import smollm2_local_dir

        folder = str(smollm2_local_dir())
    else:
        folder = args.model
    server = make_server(args.model, folder, os.path.join(tmp, "checkpoints"))
    running = start_in_thread(server)
    try:
        client = tinker.ServiceClient(base_url=running.url, api_key="tml-bench")
        training = client.create_lora_training_client(base_model=args.model, rank=16, seed=0).result()
        tokenizer = training.get_tokenizer()
        ids = tokenizer.encode("What is 12+30? The answer is 42, as anyone can check.")
        data = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
                for _ in range(args.datums)]
        raw = [(ids[:-1], {"target_tokens": torch.tensor(ids[1:]), "weights": torch.ones(len(ids) - 1)})
               for _ in range(args.datums)]
        config = loss_config("cross_entropy", None)

        def sdk_step():
            fwd_bwd = training.forward_backward(data, "cross_entropy")
            step = training.optim_step(types.AdamParams(learning_rate=1e-4))
            fwd_bwd.result()
            step.result()

        def direct_step():
            def job():
                server.host.forward_backward(training.model_id, raw, "cross_entropy", config, False)
                server.host.optim_step(training.model_id, 1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)

            server.worker.submit(job).result()

        medians = {}
        for name, fn in (("sdk", sdk_step), ("direct", direct_step)):
            fn()  # warm-up
        for name, fn in (("sdk", sdk_step), ("direct", direct_step)) * 2:  # interleaved: load drifts hit both
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            medians.setdefault(name, []).append(statistics.median(times))
        sdk, direct = min(medians["sdk"]), min(medians["direct"])
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(ids[:10])
        start = time.perf_counter()
        for _ in range(5):
            sampler.sample(prompt, 4, types.SamplingParams(max_tokens=16)).result()
        sample_ms = (time.perf_counter() - start) / 5 * 1000
        print(f"model {args.model}, {args.datums} datums x {len(ids) - 1} tokens, torch threads "
              f"{torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
        print(f"step through the SDK {sdk * 1000:.1f} ms, on the worker directly {direct * 1000:.1f} ms: "
              f"overhead {(sdk - direct) * 1000:.1f} ms per step (medians of {args.steps}, best of 2 rounds)")
        print(f"sample 4 x 16 tokens through the SDK: {sample_ms:.1f} ms")
        client.close("success").result()
    finally:
        running.stop()


if __name__ == "__main__":
    main()
