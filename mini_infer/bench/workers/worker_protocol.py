"""The worker side of peer_env.Worker, standard library only (a worker runs in its peer's own environment):
settings from argv, then one JSON line answered for each JSON line read, on a stdout that nothing else writes."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable


def serve(load: Callable[[dict], tuple[dict, Callable[[list[list[int]], list[int]], dict]]]) -> None:
    """load(settings) -> (what to report once ready, run(prompts, output_lens) -> answer). Libraries that print
    to stdout (C code too) are sent to stderr: the answers keep a private copy of the real stdout."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    try:
        ready, run = load(json.loads(sys.argv[1]))
    except Exception as error:  # noqa: BLE001 - whatever stops loading is the answer the bench shows
        traceback.print_exc()
        send({"error": f"loading failed: {type(error).__name__}: {error}"})
        return
    send({"ready": ready})
    for line in sys.stdin:
        try:
            request = json.loads(line)
            send(run(request["prompts"], request["output_lens"]))
        except Exception as error:  # noqa: BLE001 - a failed run is answered, and the worker serves on
            traceback.print_exc()
            send({"error": f"{type(error).__name__}: {error}"})
