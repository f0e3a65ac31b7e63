"""Summarize a `py-spy record --format raw --threads` profile: samples per thread, and for one
thread the inclusive / self share of each frame (function + file:line).

    py-spy record -r 50 --format raw --threads -o prof.txt -- python benches/throughput.py ...
    python benches/pyspy_summary.py prof.txt --thread ferrobatch-step --top 30
"""

from __future__ import annotations

import argparse
import collections
import sys


def frame_key(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func file.py:123"
    name, _, loc = frame.partition(" (")
    return f"{name} {loc.rstrip(')').rsplit('/', 1)[-1]}" if loc else name


def summarize(path: str, thread: str, top: int) -> str:
    threads: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    self_: collections.Counter = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            threads[frames[0]] += int(n)
            if thread not in frames[0]:
                continue
            seen = set()
            for fr in frames[1:]:
                k = frame_key(fr)
                if k not in seen:
                    incl[k] += int(n)
                    seen.add(k)
            self_[frame_key(frames[-1])] += int(n)
    total = sum(v for k, v in threads.items() if thread in k)
    out = ["samples per thread:"]
    out += [f"  {v:7d}  {k}" for k, v in threads.most_common()]
    out.append(f"\nthread '{thread}': {total} samples; inclusive share:")
    out += [f"  {100 * v / total:5.1f}%  {k}" for k, v in incl.most_common(top)]
    out.append("\nself share:")
    out += [f"  {100 * v / total:5.1f}%  {k}" for k, v in self_.most_common(top // 2)]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--thread", default="ferrobatch-step")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    print(summarize(args.raw, args.thread, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
