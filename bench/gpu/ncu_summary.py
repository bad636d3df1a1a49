"""ncu's per-kernel times (a --csv --metrics gpu__time_duration.sum run) summed by kernel name:
the total, then the kernels that took longest, each with its launches and mean time.

    python3 bench/gpu/ncu_summary.py NCU_CSV [TOP]
"""
import collections
import csv
import sys

rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if not rows:
    sys.exit("no ncu rows")
head, rows = rows[0], rows[1:]
kn, mv = head.index("Kernel Name"), head.index("Metric Value")
tot, cnt = collections.Counter(), collections.Counter()
for r in rows:
    try:
        tot[r[kn][:60]] += float(r[mv])
        cnt[r[kn][:60]] += 1
    except ValueError:
        pass
print("kernels", sum(cnt.values()), "total ms", round(sum(tot.values()) / 1e6, 3))
for k, v in tot.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 20):
    print(f"{v/1e6:8.3f} ms {cnt[k]:6d} x {v/cnt[k]/1e3:8.2f} us  {k}")
