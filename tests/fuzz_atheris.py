"""Coverage-guided fuzzing of one live broker with atheris (libFuzzer).

    python tests/fuzz_atheris.py -runs=2000 -seed=1   # any libFuzzer flags

An input is one byte choosing the method and the request's bytes. The seed corpus holds valid
requests of every method (:class:`fuzz_support.Requests`); libFuzzer mutates them, guided by
coverage of the ``broker`` package (instrumented, the server thread included). Every reply
gets the checks of :class:`fuzz_support.Fuzzer`; a failed check ends the run with a non-zero
exit and the input that broke it. ``tests/test_fuzz.py`` runs this where atheris installs.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["broker"]):
    from fuzz_support import METHODS, Fuzzer, LiveBroker, Requests

#: Seed requests written per method.
SEEDS_PER_METHOD = 3


def main() -> None:
    fuzzer = Fuzzer(LiveBroker())
    requests = Requests(fuzzer.model)
    for request in requests.every_rank():
        assert fuzzer.call("RegisterRank", request.SerializeToString()) is not None
    names = sorted(METHODS)
    corpus = Path(tempfile.mkdtemp(prefix="pdbroker-fuzz-"))
    rnd = random.Random(0)
    for i, name in enumerate(names):
        for j in range(SEEDS_PER_METHOD):
            request = requests.builders[name](lambda seq: rnd.choice(list(seq)))
            (corpus / f"{name}-{j}").write_bytes(bytes([i]) + request.SerializeToString())

    def one_input(data: bytes) -> None:
        if data:
            fuzzer.call(names[data[0] % len(names)], data[1:])

    atheris.Setup([*sys.argv, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
