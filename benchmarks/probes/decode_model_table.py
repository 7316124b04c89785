"""The decode-model table of every `*/decode_model.csv` under a folder (what the probe scripts wrote,
read back from the CSV so a run cut short still shows the batches it finished).

    python benchmarks/probes/decode_model_table.py OUT_DIR
"""

import sys
from pathlib import Path

from sparseffn.bench.decode_model import decode_model_table
from sparseffn.bench.report import read_rows

rows = [r for f in sorted(Path(sys.argv[1]).glob("*/decode_model.csv")) for r in read_rows(f)]
print(decode_model_table(rows) if rows else "no rows written (see bench.log)")
