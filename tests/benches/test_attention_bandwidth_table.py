"""The decode-bandwidth bench's table (the kernel itself runs on the GPU only): split rows show
the fused reduce's time next to the reduce pass's and their ratio; the goal line counts the
configurations at ctx >= 1k and batch >= 16."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benches"))

from attention_bandwidth import Row, format_table  # noqa: E402


def test_split_rows_show_the_fused_reduce_next_to_the_pass():
    rows = [Row("smollm2-135m", 16, 1024, 8, 12_582_912, 9.0, 1398.0, 0.333, None, None,
                "fused", 11.2),
            Row("llama3-8b", 256, 1024, 1, 1_073_741_824, 327.6, 3278.0, 0.78, None, None)]
    table = format_table(rows, 4202.0)
    lines = table.splitlines()
    assert "reduce" in lines[0] and "pass us" in lines[0] and "x pass" in lines[0]
    fused = lines[1].split()
    assert fused[4] == "fused" and "11.2" in fused and "1.24" in fused
    single = lines[2].split()
    assert single[4] == "-" and single.count("-") >= 3
    assert lines[-1].startswith("goal >= 70% of 4202 GB/s") and "1/2 configs meet it" in lines[-1]
    assert "worst 33.3% (smollm2-135m b=16 ctx=1024)" in lines[-1]
