import json, sys
from kvlab.loadgen.run import run_load
from kvlab.loadgen.trace import items_from_workload
from kvlab.serve.traffic import parse_traffic
from kvlab.serve.workload import build_workload
spec = parse_traffic({"arrival": "trace", "lengths": {"kind": "trace", "path": "trace.csv"}})
items = items_from_workload(build_workload(spec, None, None, 49152))
print([round(i.arrival_s, 3) for i in items][:4], len(items))
res = run_load("http://127.0.0.1:8323", items, sys.argv[1])
m = res.metrics
print(json.dumps({k: m[k] for k in ("completed", "ttft_mean_s", "itl_mean_s", "tpot_mean_s", "e2el_mean_s")}))
