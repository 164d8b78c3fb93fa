"""``prefzoo serve --model tiny`` builds the tiny model's folder on first use (:func:`prefzoo.serve.model_folder`).
Two servers started at once on a fresh cache (the vLLM server tests start two; CI's cache is empty) both build it:
each must end with a complete folder, whichever process wins the rename.

Before the fix both wrote the same ``<folder>.partial`` and renamed it: the loser's ``save_pretrained`` failed with
``SafetensorError: ... No such file or directory`` (its half-written folder had been renamed away), and its server
never started. The processes are started together from a barrier file, so the writes overlap."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import os, sys, time
from pathlib import Path
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.005)
from prefzoo.serve import model_folder
print(model_folder("tiny", seed=0, tiny_hidden_size=64, tiny_layers=1))
"""


def test_two_processes_building_the_served_tiny_model_at_once_both_get_a_complete_folder(tmp_path):
    env = {**os.environ, "PREFZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    time.sleep(3)  # the imports before the barrier
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-2000:]
    folders = {out.strip() for out, _ in outs}
    assert len(folders) == 1
    folder = Path(folders.pop())
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert (folder / "tokenizer_config.json").is_file()
    leftovers = [p.name for p in folder.parent.iterdir() if p != folder]
    assert leftovers == [], leftovers  # no half-written folder left behind
