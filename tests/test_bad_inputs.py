"""Every bad input a new user might give: one `kvlab CMD: error: ...` line naming the key or file,
exit status 2, no traceback, and no model loaded (``kvlab.models.load_model`` fails the test)."""

import pytest
import yaml

from kvlab.cli import main

GOOD = {"models": "tiny-llama", "weights": "synthetic", "device": "cpu", "methods": ["full", "streamingllm"],
        "keep": 0.5, "ctx": [32], "new_tokens": 3, "threads": 1}


def params_file(content):
    """Setup: write a params file (a dict is dumped as YAML; bytes/str are written as they are).
    A dict's keys (and a quality block's, as ``quality.KEY``) are the keys its row covers."""
    def setup(tmp):
        path = tmp / "p.yaml"
        if isinstance(content, dict):
            path.write_text(yaml.safe_dump({**GOOD, **content}))
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    if isinstance(content, dict):
        setup.keys = set(content) | {f"quality.{k}" for k in (content.get("quality") or {})}
        setup.methods = content.get("methods")
    return setup


def files(named):
    """Setup: write files (relative path -> text, or bytes written raw) under the tmp folder."""
    def setup(tmp):
        for name, content in named.items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
    return setup


def quality_params(block, **more):
    """Setup: a params file with a quality block, on a model with real weights (a tokenizer)."""
    return params_file({"models": "smollm2-135m", "weights": "real", "quality": block, **more})


def good_params(tmp):
    params_file({})(tmp)


SWEEP = "sweep {tmp}/p.yaml -o {tmp}/out --no-progress"
# a billion laughs: nine levels of ten aliases, 10^9 values once expanded
BOMB = "".join(f"{c}: &{c} [" + ", ".join([f"*{p}"] * 10 if p else ["1"] * 10) + "]\n"
               for p, c in zip(["", *"abcdefgh"], "abcdefghi", strict=True)) + "models: tiny-llama\nmethods: [full]\nctx: *i\n"
SMOL = ["--model", "smollm2-135m"]

# (id, argv, setup, what the error line must contain)
CASES = [
    # --- sweep: params files ----------------------------------------------------------------
    ("params-missing", "sweep {tmp}/nope.yaml", None, "nope.yaml not found"),
    ("params-is-a-folder", "sweep {tmp}", None, "not found"),
    ("params-yaml-unclosed", SWEEP, params_file("models: tiny-llama\nctx: [1\n"), "p.yaml is not valid YAML at line"),
    ("params-yaml-tab", SWEEP, params_file("models:\n\t- tiny-llama\n"), "is not valid YAML"),
    ("params-top-level-list", SWEEP, params_file("- 1\n- 2\n"), "expected a mapping"),
    ("params-top-level-scalar", SWEEP, params_file("hello\n"), "expected a mapping"),
    ("params-empty", SWEEP, params_file(""), "p.yaml is empty"),
    ("params-not-utf8", SWEEP, params_file(b"models: \xff\xfe\n"), "p.yaml is not UTF-8"),
    ("params-unknown-key", SWEEP, params_file({"ctxs": [32]}), "unknown key 'ctxs': did you mean 'ctx'?"),
    ("params-engine-unknown", SWEEP, params_file({"engine": ["turbo"]}), "engine"),
    ("params-prefill-chunk-zero", SWEEP, params_file({"prefill_chunk": [None, 0]}), "prefill_chunk"),
    ("params-prefill-chunk-in-a-method", SWEEP,
     params_file({"methods": [{"method": "snapkv", "keep": 0.5, "prefill_chunk": -1}]}), "prefill_chunk"),
    ("params-traffic-no-rate", SWEEP,
     params_file({"traffic": {"arrival": "poisson", "requests": 4, "lengths": {"kind": "fixed", "input": 8, "output": 2}}}),
     "traffic: arrival poisson needs rate"),
    ("params-traffic-bad-lengths", SWEEP,
     params_file({"traffic": {"arrival": "burst", "requests": 4, "lengths": {"kind": "zipf"}}}), "traffic.lengths.kind"),
    ("params-traffic-target-not-a-url", SWEEP,
     params_file({"traffic": {"arrival": "burst", "requests": 4, "target": "localhost:8000",
                              "lengths": {"kind": "fixed", "input": 8, "output": 2}}}), "target 'localhost:8000'"),
    ("params-traffic-in-a-static-sweep", SWEEP,
     params_file({"traffic": {"arrival": "burst", "requests": 4, "lengths": {"kind": "fixed", "input": 8, "output": 2}}}),
     "traffic: kvlab sweep runs static batches"),
    ("params-prefill-rows-zero", SWEEP, params_file({"prefill_rows": 0, "engine": "fast"}), "prefill_rows"),
    ("params-prefill-rows-list", SWEEP, params_file({"prefill_rows": [1, 2], "engine": "fast"}), "prefill_rows"),
    ("params-prefill-rows-with-hf", SWEEP, params_file({"prefill_rows": 2}), "prefill_rows: needs engine: fast"),
    ("generate-prefill-chunk-zero", "generate --model smollm2-135m --prompt hi --prefill-chunk 0", None,
     "prefill_chunk must be a whole number of tokens >= 1"),
    ("params-decoding-on-fast", SWEEP, params_file({"engine": ["fast"], "methods": [{"method": "decoding"}]}),
     "use engine hf"),
    ("params-decoding-bad-score", SWEEP, params_file({"methods": [{"method": "decoding", "score": "pyramidkv"}]}),
     "cannot drive decode-time compression"),
    ("generate-decoding-on-fast", "generate --model smollm2-135m --prompt hi --method decoding --engine fast", None,
     "use engine hf"),
    ("quality-prefill-chunk-zero", "quality --prefill-chunk none 0 -o {tmp}/q", None, "prefill_chunk must be"),
    ("params-engine-fast-hqq", SWEEP, params_file({"engine": ["hf", "fast"], "methods": [{"method": "hqq"}]}),
     "hqq's optimized scales have no kernel on the fast engine"),
    ("generate-engine-fast-hqq", "generate --model smollm2-135m --prompt hi --method hqq --engine fast", None,
     "use engine hf for hqq"),
    ("params-q-group-size", SWEEP,
     params_file({"models": "smollm2-135m", "methods": [{"method": "quanto", "q_group_size": 48}]}),
     "q_group_size=48 does not divide smollm2-135m's head_dim 64"),
    ("params-unknown-policy-param", SWEEP,
     params_file({"methods": [{"method": "snapkv", "keep": 0.5, "windw": 8}]}), "unknown parameter(s) windw"),
    ("params-perf-without-quality", SWEEP, params_file({"perf": False}), "perf: false runs the quality pass alone"),
    ("params-perf-not-a-bool", SWEEP, params_file({"perf": "sometimes"}), "perf"),
    ("params-perf-false-with-budget", SWEEP, quality_params({"lengths": [64]}, perf=False, budget_gb=1, batch=[1, 2]),
     "budget_gb: admits sequences by the performance runs' peaks"),
    ("params-quality-typo", SWEEP, quality_params({"lenghts": [64]}), "quality.lenghts"),
    ("params-quality-longbench", SWEEP, quality_params({"longbench": "/no/such/longbench.jsonl"}),
     "longbench path /no/such/longbench.jsonl does not exist"),
    ("params-quality-task", SWEEP, quality_params({"tasks": ["no_such_task"]}), "no_such_task"),
    ("params-quality-too-long", SWEEP, quality_params({"lengths": [9000]}),
     "quality.lengths: 9000"),
    # --- sweep: --set overrides ---------------------------------------------------------------
    ("set-yaml-unclosed", SWEEP + " --set ctx=[1", good_params, "--set 'ctx=[1': the value is not valid YAML"),
    ("set-no-equals", SWEEP + " --set ctx", good_params, "write key=value"),
    ("set-no-key", SWEEP + " --set =5", good_params, "write key=value"),
    ("set-ctx-zero", SWEEP + " --set ctx=0", good_params, "ctx"),
    ("set-ctx-negative", SWEEP + " --set ctx=-1", good_params, "ctx"),
    ("set-ctx-text", SWEEP + " --set ctx=abc", good_params, "ctx"),
    ("set-ctx-above-window", SWEEP + " --set ctx=5000", good_params, "above the maximum context 4096 of tiny-llama"),
    ("set-batch-zero", SWEEP + " --set batch=0", good_params, "batch"),
    ("set-batch-beyond-memory", SWEEP + " --set models=smollm2-135m --set ctx=128 --set batch=100000", good_params,
     "batch: smollm2-135m at ctx 128 x batch 100000"),
    ("set-new-tokens-zero", SWEEP + " --set new_tokens=0", good_params, "new_tokens"),
    ("set-repeats-zero", SWEEP + " --set repeats=0", good_params, "repeats"),
    ("set-prompts-zero", SWEEP + " --set prompts=0", good_params, "prompts"),
    ("set-device-tpu", SWEEP + " --set device=tpu", good_params, "device: 'tpu' is not a device"),
    ("set-device-cuda-x", SWEEP + " --set device=cuda:x", good_params, "device: 'cuda:x' is not a device"),
    ("set-dtype", SWEEP + " --set dtype=float8", good_params, "dtype: 'float8'"),
    ("set-sdpa-backend", SWEEP + " --set sdpa_backend=fast", good_params, "sdpa_backend"),
    ("set-method-unknown", SWEEP + " --set methods=[h2o]", good_params, "unknown method 'h2o'"),
    ("set-methods-empty", SWEEP + " --set methods=[]", good_params, "methods: empty"),
    ("set-keep-zero", SWEEP + " --set keep=0", good_params, "keep=0.0 is outside (0, 1]"),
    ("set-keep-above-one", SWEEP + " --set keep=1.5", good_params, "keep=1.5 is outside (0, 1]"),
    ("set-bits-3", SWEEP + " --set methods=[quanto] --set bits=3", good_params, "nbits=3"),
    ("set-model-unknown", SWEEP + " --set models=gpt-9", good_params, "unknown model 'gpt-9'"),
    ("set-model-no-weights", SWEEP + " --set models=llama-3.1-8b --set weights=null", good_params,
     "no real weights for 'llama-3.1-8b'"),
    ("set-weights-fake", SWEEP + " --set weights=fake", good_params, "weights"),
    ("set-threads-zero", SWEEP + " --set threads=0", good_params, "threads"),
    ("set-energy-interval", SWEEP + " --set energy_interval_ms=0", good_params, "energy_interval_ms"),
    ("set-time-budget", SWEEP + " --set time_budget_s=0", good_params, "time_budget_s"),
    ("set-max-runs", SWEEP + " --set max_runs=0", good_params, "max_runs"),
    ("set-retry-failed", SWEEP + " --set retry_failed=maybe", good_params, "retry_failed"),
    ("set-not-a-mapping", SWEEP + " --set ctx.x=1", good_params, "'ctx' is not a mapping"),
    ("set-ctx-dist-no-sigma", SWEEP.split() + ["--set", "ctx={dist: lognormal, median: 100}"], good_params,
     "dist: lognormal needs median (tokens) and sigma"),
    ("set-ctx-dist-unknown", SWEEP.split() + ["--set", "ctx={dist: zipf, median: 100, sigma: 1}"], good_params,
     "ctx: dist: Input should be 'lognormal'"),
    ("set-ctx-file-missing", SWEEP.split() + ["--set", "ctx={file: lengths.txt}"], good_params,
     "ctx.file: lengths.txt not found"),
    ("set-ctx-file-not-numbers", SWEEP.split() + ["--set", "ctx={file: lengths.txt}"],
     lambda tmp: (good_params(tmp), files({"lengths.txt": "12\nabc\n"})(tmp)), "lengths.txt line 2"),
    ("set-weights-quant-int3", SWEEP + " --set weights_quant=int3", good_params, "weights_quant"),
    ("set-weights-quant-fast", SWEEP + " --set weights_quant=int8 --set engine=fast", good_params,
     "weights_quant: int8 with engine: fast"),
    ("set-budget-negative", SWEEP + " --set budget_gb=-1 --set batch=[1,2]", good_params, "budget_gb: -1"),
    ("set-budget-one-batch", SWEEP + " --set budget_gb=10", good_params, "with budget_gb: list 1"),
    ("set-budget-gpu-on-cpu", SWEEP + " --set budget_gb=gpu --set batch=[1,2]", good_params,
     "budget_gb: gpu needs device: cuda"),
    ("set-budget-cap-alone", SWEEP + " --set budget_max_batch=4", good_params, "budget_max_batch: only used"),
    # --- sweep: output folder and its files ---------------------------------------------------
    ("out-is-a-file", "sweep {tmp}/p.yaml -o {tmp}/afile", lambda t: (good_params(t), files({"afile": "x"})(t)),
     "afile is a file, not a folder"),
    ("out-under-a-file", "sweep {tmp}/p.yaml -o {tmp}/afile/sub", lambda t: (good_params(t), files({"afile": "x"})(t)),
     "cannot write there"),
    ("out-under-proc", "sweep {tmp}/p.yaml -o /proc/kvlab-test/out", good_params, "/proc/kvlab-test/out"),
    ("out-dry-run-is-a-file", "sweep {tmp}/p.yaml -o {tmp}/afile --dry-run",
     lambda t: (good_params(t), files({"afile": "x"})(t)), "afile is a file"),
    ("out-damaged-manifest", SWEEP, lambda t: (good_params(t), files({"out/manifest.json": "{not json"})(t)),
     "manifest.json is damaged"),
    ("out-manifest-list", SWEEP, lambda t: (good_params(t), files({"out/manifest.json": "[1, 2]"})(t)),
     "manifest.json holds a list"),
    # --- generate -------------------------------------------------------------------------------
    ("generate-model-unknown", "generate --model gpt-9 --prompt hi", None, "unknown model 'gpt-9'"),
    ("generate-model-path-missing", "generate --model /no/such/model --prompt hi", None, "/no/such/model"),
    ("generate-model-folder-without-config", "generate --model {tmp}/m --prompt hi", files({"m/x": "1"}),
     "has no config.json"),
    ("generate-no-weights", "generate --model llama-3.1-8b --prompt-tokens 8", None,
     "no real weights for 'llama-3.1-8b'"),
    ("generate-prompt-tokens-above-window", "generate --model smollm2-135m --prompt-tokens 9000", None,
     "--prompt-tokens: 9000 + --max-new-tokens 16 is above the maximum context 8192"),
    ("generate-prompt-tokens-zero", "generate --model smollm2-135m --prompt-tokens 0", None, "--prompt-tokens"),
    ("generate-prompt-tokens-negative", "generate --model smollm2-135m --prompt-tokens -5", None, "--prompt-tokens"),
    ("generate-prompt-file-missing", "generate --model smollm2-135m --prompt-file {tmp}/nope.txt", None,
     "nope.txt does not exist"),
    ("generate-prompt-file-empty", "generate --model smollm2-135m --prompt-file {tmp}/e.txt", files({"e.txt": " \n"}),
     "e.txt is empty"),
    ("generate-prompt-file-not-utf8", "generate --model smollm2-135m --prompt-file {tmp}/b.txt",
     files({"b.txt": b"\xff\xfe\x00"}), "b.txt is not UTF-8"),
    ("generate-prompt-file-folder", "generate --model smollm2-135m --prompt-file {tmp}", None, "is not a file"),
    ("generate-prompt-empty", ["generate", "--model", "smollm2-135m", "--prompt", ""], None, "--prompt is empty"),
    ("generate-device-cuda-x", "generate --model smollm2-135m --prompt hi --device cuda:x", None,
     "--device: 'cuda:x' is not a device"),
    ("generate-device-tpu", "generate --model smollm2-135m --prompt hi --device tpu", None,
     "--device: 'tpu' is not a device"),
    ("generate-dtype", "generate --model smollm2-135m --prompt hi --dtype float8", None, "--dtype 'float8'"),
    ("generate-max-new-tokens", "generate --model smollm2-135m --prompt hi --max-new-tokens 0", None,
     "--max-new-tokens"),
    ("generate-method-unknown", "generate --model smollm2-135m --prompt hi --method h2o", None, "unknown method 'h2o'"),
    ("generate-full-with-bits", "generate --model smollm2-135m --prompt hi --bits 4", None, "--method full stores"),
    ("generate-group-size", "generate --model smollm2-135m --prompt hi --method quanto --group-size 48", None,
     "q_group_size=48 does not divide"),
    ("generate-keep-zero", "generate --model smollm2-135m --prompt hi --method snapkv --keep 0", None, "keep=0"),
    ("generate-backend-contradiction", "generate --model smollm2-135m --prompt hi --method quanto --backend hqq",
     None, "--backend hqq contradicts --method quanto"),
    ("generate-synthetic-text", "generate --model smollm2-135m --weights synthetic --prompt hi", None,
     "synthetic weights come without a tokenizer"),
    ("generate-scorer-unknown", "generate --model smollm2-135m --prompt hi --method adakv --scorer h2o", None,
     "adakv scorer 'h2o' is not supported"),
    ("generate-scorer-on-snapkv", "generate --model smollm2-135m --prompt hi --method snapkv --scorer tova", None,
     "unknown parameter"),
    ("generate-alpha-safeguard", "generate --model smollm2-135m --prompt hi --method adakv --alpha-safeguard 1.5",
     None, "alpha_safeguard must be a number in [0, 1]"),
    ("generate-scope", "generate --model smollm2-135m --prompt hi --method adakv --scope model", None,
     "only the kvzip scorer"),
    ("generate-param-no-value", "generate --model smollm2-135m --prompt hi --method snapkv --param keep", None,
     "write KEY=VALUE"),
    ("generate-param-unknown", "generate --model smollm2-135m --prompt hi --method snapkv --param nope=1", None,
     "unknown parameter"),
    # --- anatomy --------------------------------------------------------------------------------
    ("anatomy-ctx-negative", "anatomy --ctx -1", None, "--ctx: -1 must be at least 1"),
    ("anatomy-ctx-zero", "anatomy --ctx 0", None, "--ctx: 0 must be at least 1"),
    ("anatomy-ctx-above-window", "anatomy --ctx 8190", None, "above the maximum context 8192"),
    ("anatomy-method-unknown", "anatomy --methods full h2o", None, "unknown method 'h2o'"),
    ("anatomy-sdpa-backend", "anatomy --sdpa-backend fast", None, "--sdpa-backend 'fast'"),
    ("anatomy-params-not-json", ["anatomy", "--params", "{bad"], None, "--params is not JSON"),
    ("anatomy-params-list", ["anatomy", "--params", "[1]"], None, "--params must map method names"),
    ("anatomy-params-unknown", ["anatomy", "--methods", "snapkv", "--params", '{"snapkv": {"windw": 3}}'], None,
     "unknown parameter(s) windw"),
    ("anatomy-params-other-method", ["anatomy", "--methods", "full", "--params", '{"quanto": {}}'], None,
     "--params names quanto"),
    ("anatomy-device-tpu", "anatomy --device tpu", None, "--device: 'tpu' is not a device"),
    ("anatomy-steps-zero", "anatomy --steps 0", None, "--steps and --warmup"),
    ("anatomy-warmup-zero", "anatomy --warmup 0", None, "--steps and --warmup"),
    ("anatomy-model-unknown", "anatomy --model gpt-9", None, "unknown model 'gpt-9'"),
    ("anatomy-no-weights", "anatomy --model mistral-7b", None, "no real weights for 'mistral-7b'"),
    # --- quality --------------------------------------------------------------------------------
    ("quality-out-is-a-file", "quality -o {tmp}/afile", files({"afile": "x"}), "afile is a file"),
    ("quality-out-under-proc", "quality -o /proc/kvlab-test", None, "/proc/kvlab-test: cannot write there"),
    ("quality-longbench-missing", "quality -o {tmp}/q --longbench {tmp}/lb.jsonl", None, "lb.jsonl does not exist"),
    ("quality-lengths-zero", "quality -o {tmp}/q --lengths 0", None, "--lengths"),
    ("quality-weights-quant-fast", "quality -o {tmp}/q --weights-quant int4 --engine fast", None,
     "weights_quant: int4 with engine: fast"),
    ("quality-weights-quant-other-folder", "quality -o {tmp}/q --weights-quant int8",
     files({"q/manifest.json": '{"kind": "quality", "weights_quant": "int4"}'}), "holds records with --weights-quant int4"),
    ("quality-lengths-above-window", "quality -o {tmp}/q --lengths 9000", None, "above the maximum context 8192"),
    ("quality-depths", "quality -o {tmp}/q --depths 2", None, "--depths"),
    ("quality-samples", "quality -o {tmp}/q --samples 0", None, "--samples"),
    ("quality-task-unknown", "quality -o {tmp}/q --tasks no_such_task", None, "no_such_task"),
    ("quality-method-unknown", "quality -o {tmp}/q --methods h2o", None, "unknown method 'h2o'"),
    ("quality-keep-zero", "quality -o {tmp}/q --methods snapkv --keep 0", None, "keep=0"),
    ("quality-device-tpu", "quality -o {tmp}/q --device tpu", None, "--device: 'tpu' is not a device"),
    ("quality-text-missing", "quality -o {tmp}/q --tasks continuation --text {tmp}/t.txt", None, "t.txt"),
    ("quality-max-new-tokens", "quality -o {tmp}/q --max-new-tokens 0", None, "--max-new-tokens"),
    ("quality-dtype", "quality -o {tmp}/q --dtype float8", None, "--dtype 'float8'"),
    ("quality-lengths-too-short-for-the-task", "quality -o {tmp}/q --lengths 20", None,
     "quality on smollm2-135m: length 20 is too short for task 'niah_single'"),
    ("quality-param-no-method-takes-it", "quality -o {tmp}/q --methods full snapkv --param budget=256", None,
     "--param budget: none of --methods full snapkv takes it"),
    ("quality-param-not-key-value", "quality -o {tmp}/q --methods quest --param budget", None, "write KEY=VALUE"),
    ("quality-param-keep", "quality -o {tmp}/q --methods snapkv --param keep=0.5", None, "give keep with --keep"),
    ("quality-param-quest-budget-zero", "quality -o {tmp}/q --methods quest --param budget=0", None, "budget"),
    ("quality-methods-entry-bad-yaml", ["quality", "-o", "{tmp}/q", "--methods", "{method: quest"], None,
     "is not valid YAML"),
    ("quality-methods-entry-no-method", ["quality", "-o", "{tmp}/q", "--methods", "{budget: 256}"], None,
     "write a method entry as {method: NAME"),
    ("quality-methods-entry-unknown-param", ["quality", "-o", "{tmp}/q", "--methods", "{method: quest, budgett: 9}"],
     None, "unknown parameter(s) budgett for quest"),
    ("models-folder-missing", "models {tmp}/nope", None, "nope does not exist"),
    ("quality-no-weights", "quality -o {tmp}/q --model qwen2.5-7b", None, "no real weights for 'qwen2.5-7b'"),
    # --- budget ---------------------------------------------------------------------------------
    ("budget-ctx-above-window", "budget --model llama-3.1-8b --ctx 200000", None,
     "--ctx: 200000 + --new-tokens 0 is above the maximum context 131072"),
    ("budget-ctx-zero", "budget --model llama-3.1-8b --ctx 0", None, "--ctx must be a positive integer"),
    ("budget-bandwidth-zero", "budget --model llama-3.1-8b --ctx 1024 --bandwidth 0", None, "--bandwidth"),
    ("budget-memory-negative", "budget --model llama-3.1-8b --ctx 1024 --memory -1", None, "--memory"),
    ("budget-reserve-negative", "budget --model llama-3.1-8b --ctx 1024 --gpu h200 --reserve -1", None, "--reserve"),
    ("budget-batch-zero", "budget --model llama-3.1-8b --ctx 1024 --batch 0", None, "--batch"),
    ("budget-gpu-unknown", "budget --model llama-3.1-8b --ctx 1024 --gpu b300", None, "unknown GPU 'b300'"),
    ("budget-model-unknown", "budget --model gpt-9 --ctx 1024", None, "unknown model 'gpt-9'"),
    ("budget-no-ctx", "budget --model llama-3.1-8b", None, "give --ctx N (one length) or --ctx-dist"),
    ("budget-ctx-and-dist", ["budget", "--model", "llama-3.1-8b", "--ctx", "5", "--ctx-dist", "{file: x}"], None,
     "give --ctx N (one length) or --ctx-dist"),
    ("budget-ctx-dist-not-mapping", ["budget", "--model", "llama-3.1-8b", "--ctx-dist", "lognormal"], None,
     "--ctx-dist 'lognormal': write a mapping"),
    ("budget-ctx-dist-no-median", ["budget", "--model", "llama-3.1-8b", "--ctx-dist", "{dist: lognormal}"], None,
     "--ctx-dist: dist: lognormal needs median"),
    ("budget-ctx-dist-missing-file", ["budget", "--model", "llama-3.1-8b", "--ctx-dist", "{file: nope.txt}"], None,
     "ctx.file: nope.txt not found"),
    ("budget-keep-zero", "budget --model llama-3.1-8b --ctx 1024 --keep 0", None, "keep=0"),
    ("budget-group-size", "budget --model llama-3.1-8b --ctx 1024 --bits 4 --group-size 48", None,
     "group size 48 does not divide"),
    ("budget-new-tokens-negative", "budget --model llama-3.1-8b --ctx 1024 --new-tokens -1", None, "new_tokens"),
    # --- report: records folders and files -----------------------------------------------------
    ("report-missing-folder", "report {tmp}/nope", None, "nope does not exist"),
    ("report-a-file", "report {tmp}/afile", files({"afile": "x"}), "afile is a file"),
    ("report-empty-folder", "report {tmp}/empty", lambda t: (t / "empty").mkdir(), "no records.jsonl in"),
    ("report-unrelated-folder", "report {tmp}/src", files({"src/a.py": "print(1)", "src/notes.md": "# notes"}),
     "no records.jsonl in"),
    ("report-only-damaged-records", "report {tmp}/s",
     files({"s/records.jsonl": b'123\nnull\n"x"\n[1, 2]\n{"run_id": 5}\n\xff\xfe\n{"run_id": "a", "sta\n'}),
     "records.jsonl: no readable record"),
    ("report-out-not-html", "report {tmp}/s -o {tmp}/r.pdf", files({"s/records.jsonl": '{"run_id": "a"}\n'}),
     "must end in .html"),
    ("report-out-under-a-file", "report {tmp}/s -o {tmp}/afile/r.html",
     files({"s/records.jsonl": '{"run_id": "a"}\n', "afile": "x"}), "is a file, not a folder"),
    ("report-notebook-missing", "report {tmp}/s --notebook {tmp}/nb.ipynb", files({"s/records.jsonl": '{"run_id": "a"}\n'}),
     "nb.ipynb does not exist"),
    ("report-ctx-zero", "report {tmp}/s --ctx 0", files({"s/records.jsonl": '{"run_id": "a"}\n'}), "--ctx"),
    ("report-parity-missing", "report {tmp}/s --parity {tmp}/parity.json", files({"s/records.jsonl": '{"run_id": "a"}\n'}),
     "--parity"),
    ("report-timeout-zero", "report {tmp}/s --timeout 0", files({"s/records.jsonl": '{"run_id": "a"}\n'}), "--timeout"),
    # --- issue #31: the last unclear cases ----------------------------------------------------------
    ("params-budget-above-memory", SWEEP + " --set budget_gb=1000000 --set batch=[1,2]", good_params,
     "budget_gb: 1,000,000 GB is above the"),
    ("params-quality-synthetic-weights", SWEEP, params_file({"quality": {"tasks": ["niah_single"], "lengths": [64]}}),
     "quality: needs a tokenizer, and synthetic weights come without one"),
    ("set-ctx-file-above-window", SWEEP.split() + ["--set", "ctx={file: lengths.txt}"],
     lambda tmp: (good_params(tmp), files({"lengths.txt": "100\n9000\n"})(tmp)),
     "ctx.file lengths.txt: 1 of 2 lengths (up to 9000) are above 4093 (tiny-llama's window 4096 minus new_tokens 3); "
     "add max: 4093"),
    ("budget-ctx-dist-file-above-window", ["budget", "--model", "tiny-llama", "--ctx-dist", "{file: l.txt}"],
     files({"l.txt": "100\n9000\n"}), "--ctx-dist.file l.txt: 1 of 2 lengths (up to 9000) are above 4096"),
    ("sweep-ray-address-nothing-listens", SWEEP + " --executor ray --ray-address 127.0.0.1:9", good_params,
     "ray_address: nothing answers at 127.0.0.1:9 (connection refused)"),
    ("sweep-ray-address-not-an-address", SWEEP + " --executor ray --ray-address head", good_params,
     "ray_address: 'head' is not an address"),
    ("set-ray-address-without-ray", SWEEP + " --set ray_address=auto", good_params, "ray_address: only used with"),
    ("report-half-written-manifest", "report {tmp}/s",
     files({"s/records.jsonl": '{"run_id": "a"}\n', "s/manifest.json": '{"sweep": "s", "run_ids": ["a", "b'}),
     "manifest.json is damaged"),
    ("report-baseline-unknown", "report {tmp}/s --baseline nope",
     files({"s/records.jsonl": '{"run_id": "a", "method": "full"}\n{"run_id": "b", "method": "snapkv"}\n'}),
     "--baseline 'nope' is no method in"),
    ("set-model-weights-above-memory", SWEEP + " --set models=llama-3.1-70b", good_params,
     "models: llama-3.1-70b's weights alone need 262.8 GiB in float32, but cpu has 64.0 GiB available; use a "
     "smaller model or dtype: bfloat16"),
    ("generate-model-weights-above-memory", "generate --model llama-3.1-70b --weights synthetic --prompt-tokens 8", None,
     "--model: llama-3.1-70b's weights alone need"),
    ("generate-decoding-with-bits", "generate --model smollm2-135m --prompt hi --method decoding --bits 4", None,
     "--bits: --method decoding stores the model dtype"),
    ("generate-decoding-with-backend", "generate --model smollm2-135m --prompt hi --method decoding --backend hqq", None,
     "--backend: --method decoding stores the model dtype"),
    ("generate-decoding-target-zero", "generate --model smollm2-135m --prompt hi --method decoding --target 0", None,
     "target"),
    ("generate-decoding-interval-zero", "generate --model smollm2-135m --prompt hi --method decoding --interval 0", None,
     "interval"),
    ("generate-decoding-score-unknown", "generate --model smollm2-135m --prompt hi --method decoding --score pyramidkv",
     None, "score='pyramidkv' cannot drive decode-time compression"),
    ("generate-target-with-snapkv", "generate --model smollm2-135m --prompt hi --method snapkv --target 64", None,
     "unknown parameter(s) target"),
    # --- every other sweep key --------------------------------------------------------------------------
    ("set-name-list", SWEEP + " --set name=[1]", good_params, "name: Input should be a valid string"),
    ("set-attn-implementation", SWEEP + " --set attn_implementation=flash", good_params, "attn_implementation: 'flash'"),
    ("set-seed-text", SWEEP + " --set seed=abc", good_params, "seed"),
    ("set-warmup-runs-negative", SWEEP + " --set warmup_runs=-1", good_params, "warmup_runs"),
    ("set-idle-s-negative", SWEEP + " --set idle_s=-1", good_params, "idle_s"),
    ("set-jitter-ms-above", SWEEP + " --set jitter_ms=5000", good_params, "jitter_ms"),
    ("set-timelines", SWEEP + " --set timelines=maybe", good_params, "timelines"),
    ("set-executor-unknown", SWEEP + " --set executor=slurm", good_params, "executor"),
    ("sweep-executor-flag-unknown", SWEEP + " --executor slurm", good_params, "argument --executor: invalid choice"),
    ("params-quality-depths", SWEEP, quality_params({"depths": [2]}), "quality.depths"),
    ("params-quality-samples", SWEEP, quality_params({"samples": 0}), "quality.samples"),
    ("params-quality-seed", SWEEP, quality_params({"seed": "x"}), "quality.seed"),
    ("params-quality-query-aware", SWEEP, quality_params({"query_aware": "maybe"}), "quality.query_aware"),
    ("params-quality-no-signal-threshold", SWEEP, quality_params({"no_signal_threshold": 2}),
     "quality.no_signal_threshold"),
    ("params-quality-max-new-tokens", SWEEP, quality_params({"max_new_tokens": 0}), "quality.max_new_tokens"),
    ("params-quality-longbench-datasets", SWEEP, quality_params({"longbench_datasets": ["qasper"]}),
     "quality.longbench_datasets"),
    ("params-quality-text-files", SWEEP, quality_params({"tasks": ["continuation"], "text_files": ["no.txt"]}),
     "quality.text_files"),
    ("params-quality-continuation-tokens", SWEEP, quality_params({"continuation_tokens": 0}),
     "quality.continuation_tokens"),
    ("params-quality-min-context-gain", SWEEP, quality_params({"min_context_gain": -1}),
     "quality.min_context_gain"),
    ("set-ctx-dist-samples-zero", SWEEP.split() + ["--set", "ctx={dist: lognormal, median: 100, sigma: 1, samples: 0}"],
     good_params, "samples"),
    ("set-ctx-dist-max-below-min", SWEEP.split() + ["--set", "ctx={dist: lognormal, median: 100, sigma: 1, min: 50, "
                                                              "max: 10}"], good_params, "max 10 is below min 50"),
    ("set-ctx-dist-and-file", SWEEP.split() + ["--set", "ctx={dist: lognormal, median: 100, sigma: 1, file: l.txt}"],
     good_params, "not both"),
    ("set-ctx-dist-unknown-key", SWEEP.split() + ["--set", "ctx={dist: lognormal, median: 100, sigma: 1, medain: 3}"],
     good_params, "medain"),
    ("set-ctx-file-jsonl-without-field", SWEEP.split() + ["--set", "ctx={file: r.jsonl}"],
     lambda tmp: (good_params(tmp), files({"r.jsonl": '{"prompt_tokens": 5}\n'})(tmp)), "a JSONL file needs field: KEY"),
    ("set-ctx-file-empty", SWEEP.split() + ["--set", "ctx={file: l.txt}"],
     lambda tmp: (good_params(tmp), files({"l.txt": "# none\n"})(tmp)), "holds no lengths"),
    ("params-decoding-target-zero", SWEEP, params_file({"methods": [{"method": "decoding", "target": 0}]}), "target"),
    ("params-decoding-interval-zero", SWEEP, params_file({"methods": [{"method": "decoding", "interval": 0}]}),
     "interval"),
    ("params-decoding-window-above-interval", SWEEP,
     params_file({"methods": [{"method": "decoding", "target": 64, "interval": 8}]}), "longer than interval=8"),
    ("params-decoding-score-params-list", SWEEP, params_file({"methods": [{"method": "decoding", "score_params": [1]}]}),
     "score_params must be a mapping"),
    ("params-decoding-score-params-unknown", SWEEP,
     params_file({"methods": [{"method": "decoding", "score_params": {"windw": 8}}]}), "windw"),
    ("params-quant-not-a-mapping", SWEEP, params_file({"methods": [{"method": "snapkv", "keep": 0.5, "quant": "int4"}]}),
     "quant must be a dict"),
    ("params-fp8-bits-4", SWEEP, params_file({"methods": [{"method": "fp8", "bits": [4]}]}), "nbits=4"),
    ("params-kvq-int2-group-size", SWEEP, params_file({"methods": [{"method": "kvq-int2", "q_group_size": 48}]}),
     "q_group_size=48"),
    ("params-kvq-group-above-head-dim", SWEEP, params_file({"methods": ["kvq-int4"]}),
     "head_dim 16 is not a multiple of group 64; no group this format has (32, 64, 128) divides it; store it with "
     "a format without groups (kvq-fp8) or quanto/hqq with q_group_size 16"),
    ("params-kvq-group-not-dividing", SWEEP, params_file({"models": "smollm2-135m",
                                                          "methods": [{"method": "kvq-int4", "q_group_size": 128}]}),
     "head_dim 64 is not a multiple of group 128; pick a group (q_group_size) from 32, 64"),
    # --- issue #29's reads (kivi, quest) ----------------------------------------------------------------
    ("params-kivi-value-group-not-dividing", SWEEP, params_file({"methods": [{"method": "kivi", "value_group": 32}]}),
     "value_group=32 does not divide tiny-llama's head_dim 16"),
    ("params-kivi-bits-3", SWEEP, params_file({"methods": [{"method": "kivi", "bits": [3], "key_bits": 4}]}),
     "nbits=3"),
    ("params-kivi-residual-negative", SWEEP, params_file({"methods": [{"method": "kivi", "residual_length": -1}]}),
     "residual_length"),
    ("params-kivi-rot-seed-negative", SWEEP, params_file({"methods": [{"method": "kivi-rot", "seed": -1}]}),
     "seed must be >= 0"),
    ("params-kivi-rot-value-group-not-dividing", SWEEP,
     params_file({"methods": [{"method": "kivi-rot", "value_group": 32}]}),
     "value_group=32 does not divide tiny-llama's head_dim 16"),
    ("params-quest-dense-layers-above-layers", SWEEP, params_file({"methods": [{"method": "quest", "dense_layers": 9}]}),
     "dense_layers=9 exceeds"),
    ("params-quest-budget-one-page", SWEEP, params_file({"methods": [{"method": "quest", "page": 32, "budget": 32}]}),
     "budget=32 tokens must hold two pages of 32"),
    ("params-quest-group-reduce", SWEEP, params_file({"methods": [{"method": "quest", "group_reduce": "head"}]}),
     "group_reduce='head'"),
    ("params-quest-format", SWEEP, params_file({"methods": [{"method": "quest", "format": "int3"}]}),
     "format='int3' is not a quest format"),
    ("params-quest-format-group-not-dividing", SWEEP, params_file({"methods": [{"method": "quest",
                                                                              "format": "int4-g64"}]}),
     "quest format=int4-g64 cannot store tiny-llama"),
    # --- codec storages (nvfp4, turboquant, kvq-rot) ---------------------------------------------------
    ("params-nvfp4-four-over-six-not-bool", SWEEP,
     params_file({"methods": [{"method": "nvfp4", "four_over_six": 3}]}), "four_over_six must be true or false"),
    ("params-turboquant-variant", SWEEP, params_file({"methods": [{"method": "turboquant", "variant": "2bit"}]}),
     "variant='2bit' is not a turboquant preset: use one of k8v4, 4bit, k3v4, 3bit"),
    ("params-turboquant-seed-negative", SWEEP, params_file({"methods": [{"method": "turboquant", "seed": -1}]}),
     "seed must be >= 0"),
    ("params-kvq-rot-format", SWEEP, params_file({"methods": [{"method": "kvq-rot", "format": "int3-g64"}]}),
     "format='int3-g64' is not a kvq-rot format"),
    ("params-kvq-rot-group-above-head-dim", SWEEP, params_file({"methods": [{"method": "kvq-rot", "format": "int4-g64"}]}),
     "kvq-rot format='int4-g64' groups do not divide tiny-llama's head_dim 16: use one of fp8"),
    # --- issue #27's methods: each parameter refused with its name and range ----------------------------
    ("params-ea-future-zero", SWEEP, params_file({"methods": [{"method": "expected_attention", "n_future_positions": 0}]}),
     "n_future_positions must be >= 1, got 0"),
    ("params-ea-covariance-text", SWEEP, params_file({"methods": [{"method": "expected_attention", "use_covariance": "yes"}]}),
     "use_covariance must be true or false"),
    ("params-ea-vnorm-number", SWEEP, params_file({"methods": [{"method": "expected_attention", "use_vnorm": 3}]}),
     "use_vnorm must be true or false"),
    ("params-ea-epsilon-negative", SWEEP, params_file({"methods": [{"method": "expected_attention", "epsilon": -1}]}),
     "epsilon must be a finite number >= 0"),
    ("params-adakv-alpha-above-one", SWEEP, params_file({"methods": [{"method": "adakv", "alpha_safeguard": 1.5}]}),
     "alpha_safeguard must be a number in [0, 1]"),
    ("params-adakv-scope-unknown", SWEEP, params_file({"methods": [{"method": "adakv", "scope": "global"}]}),
     "scope must be 'layer' or 'model'"),
    ("params-adakv-scope-model-on-fast", SWEEP,
     params_file({"engine": ["fast"], "methods": [{"method": "adakv", "scorer": "kvzip", "scope": "model"}]}),
     "use scope='layer'"),
    ("params-adakv-scorer-unknown", SWEEP, params_file({"methods": [{"method": "adakv", "scorer": "nope"}]}),
     "adakv scorer 'nope' is not supported: use one of"),
    ("params-adakv-scorer-params-bad", SWEEP,
     params_file({"methods": [{"method": "adakv", "scorer_params": {"window_size": 0}}]}), "window_size must be >= 1"),
    ("params-kvzip-chunk-zero", SWEEP, params_file({"methods": [{"method": "kvzip", "chunk_size": 0}]}),
     "chunk_size must be >= 1, got 0"),
    ("params-kvzip-postfix-negative", SWEEP, params_file({"methods": [{"method": "kvzip", "prev_postfix_size": -1}]}),
     "prev_postfix_size must be >= 0"),
    ("params-kvzap-surrogate-missing", SWEEP,
     params_file({"methods": [{"method": "kvzap", "surrogate": "/no/such/kvzap.safetensors"}]}),
     "surrogate '/no/such/kvzap.safetensors' is not a file"),
    ("params-kvzap-n-sink-negative", SWEEP, params_file({"methods": [{"method": "kvzap", "n_sink": -1}]}),
     "n_sink must be >= 0"),
    ("params-kvzap-window-text", SWEEP, params_file({"methods": [{"method": "kvzap", "window": "all"}]}),
     "window must be an integer"),
    ("params-kvzap-no-surrogate-for-the-model", SWEEP,
     params_file({"methods": [{"method": "kvzap"}]}), "no KVzap surrogate is packaged for tiny-llama"),
    # --- every other flag ---------------------------------------------------------------------------------
    ("generate-seed-text", "generate --model smollm2-135m --prompt hi --seed abc", None, "argument --seed"),
    ("generate-window-size-zero", "generate --model smollm2-135m --prompt hi --method snapkv --window-size 0", None,
     "window_size"),
    ("generate-kernel-size-even", "generate --model smollm2-135m --prompt hi --method snapkv --kernel-size 4", None,
     "kernel_size"),
    ("generate-n-sink-negative", "generate --model smollm2-135m --prompt hi --method streamingllm --n-sink -1", None,
     "n_sink"),
    ("generate-beta-zero", "generate --model smollm2-135m --prompt hi --method pyramidkv --beta 0", None, "beta"),
    ("generate-policy-seed-text", "generate --model smollm2-135m --prompt hi --method random --policy-seed x", None,
     "argument --policy-seed"),
    ("generate-residual-negative", "generate --model smollm2-135m --prompt hi --method quanto --residual -1", None,
     "residual_length"),
    ("generate-axis-key", "generate --model smollm2-135m --prompt hi --method quanto --axis-key 2", None, "axis_key"),
    ("generate-quanto-axis-per-channel", "generate --model smollm2-135m --prompt hi --method quanto --axis-key -1",
     None, "quanto's per-channel axis (-1)"),
    ("generate-key-offset", "generate --model smollm2-135m --prompt hi --method kvq-int4 --key-offset bias", None,
     "key_offset='bias' is not supported by the kvq backend: use one of prompt-mean, none"),
    ("generate-key-offset-quanto", "generate --model smollm2-135m --prompt hi --method quanto --key-offset prompt-mean",
     None, "key_offset"),
    ("generate-axis-value", "generate --model smollm2-135m --prompt hi --method quanto --axis-value 2", None,
     "axis_value"),
    ("generate-kivi-key-bits", "generate --model smollm2-135m --prompt hi --method kivi --key-bits 3", None,
     "key_bits=3"),
    ("generate-kivi-value-group", "generate --model smollm2-135m --prompt hi --method kivi --value-group 48", None,
     "value_group=48"),
    ("generate-kivi-group-size", "generate --model smollm2-135m --prompt hi --method kivi --group-size 24", None,
     "q_group_size=24"),
    ("generate-quest-page", "generate --model smollm2-135m --prompt hi --method quest --page 12", None,
     "page must be a power of two"),
    ("generate-quest-token-budget", "generate --model smollm2-135m --prompt hi --method quest --token-budget 16", None,
     "budget=16 tokens must hold two pages"),
    ("generate-quest-group-reduce", "generate --model smollm2-135m --prompt hi --method quest --group-reduce mean",
     None, "group_reduce='mean'"),
    ("generate-quest-dense-layers", "generate --model smollm2-135m --prompt hi --method quest --dense-layers -1", None,
     "dense_layers must be >= 0"),
    ("generate-quest-flag-on-full", "generate --model smollm2-135m --prompt hi --page 16", None,
     "unknown parameter(s) page for full"),
    ("generate-engine-unknown", "generate --model smollm2-135m --prompt hi --engine turbo", None,
     "argument --engine: invalid choice"),
    ("quality-engine-unknown", "quality -o {tmp}/q --engine turbo", None, "argument --engine: invalid choice"),
    ("anatomy-engine-unknown", "anatomy --engine turbo", None, "argument --engine: invalid choice"),
    ("anatomy-weights-unknown", "anatomy --weights fake", None, "argument --weights: invalid choice"),
    ("budget-residual-negative", "budget --model llama-3.1-8b --ctx 1024 --bits 4 --residual -1", None, "--residual"),
    ("quality-bits-3-quanto", "quality -o {tmp}/q --methods quanto --bits 3", None, "nbits=3"),
    ("quality-continuation-tokens", "quality -o {tmp}/q --tasks continuation --continuation-tokens 0", None,
     "--continuation-tokens"),
    ("quality-longbench-datasets-alone", "quality -o {tmp}/q --longbench-datasets qasper", None, "--longbench-datasets"),
    ("quality-seed-text", "quality -o {tmp}/q --seed x", None, "argument --seed"),
    ("quality-threshold", "quality -o {tmp}/q --threshold 2", None, "--threshold"),
    ("quality-weights-synthetic", "quality -o {tmp}/q --weights synthetic", None, "--weights synthetic comes without a tokenizer"),
    # --- nothing silently reinterpreted, nothing that hangs -------------------------------------------
    ("params-duplicate-key", SWEEP, params_file("models: tiny-llama\nweights: synthetic\nmethods: [full]\nctx: [32]\n"
                                                "new_tokens: 3\nctx: [64]\n"),
     "p.yaml gives the key 'ctx' twice (lines 4 and 6); keep one"),
    ("params-duplicate-key-in-a-method", SWEEP,
     params_file("models: tiny-llama\nweights: synthetic\nctx: [32]\nmethods:\n  - {method: snapkv, keep: 0.5, keep: 0.1}\n"),
     "gives the key 'keep' twice"),
    ("params-alias-bomb", SWEEP, params_file(BOMB), "p.yaml expands to more than 100,000 values"),
    ("params-10-mb-list", SWEEP, params_file("ctx: [" + "4096, " * 1_666_000 + "4096]\n"),
     "p.yaml is 10.0 MB; kvlab reads at most 1 MB of YAML"),
    ("set-plan-too-large", SWEEP + " --set repeats=1000000", good_params,
     "the plan has 2,000,000 runs (models x weights_quant x ctx x batch x repeats x prompts x method variants x engine); "
     "a sweep plans at most 100,000"),
    ("set-ctx-dist-samples-too-many", SWEEP.split() + ["--set", "ctx={dist: lognormal, median: 100, sigma: 1, "
                                                                "samples: 2500000}"], good_params, "a sweep plans at most"),
    ("set-engine-twice", SWEEP + " --set engine=[hf,hf]", good_params, "engine: 'hf' is listed twice; list each value once"),
    ("set-methods-twice", SWEEP + " --set methods=[full,streamingllm,full]", good_params, "methods: 'full' is listed twice"),
    ("params-identical-method-entries", SWEEP,
     params_file({"methods": [{"method": "snapkv", "keep": 0.5}, {"method": "snapkv", "keep": 0.5}]}),
     "methods: {'keep': 0.5, 'method': 'snapkv'} is listed twice"),
    ("params-method-variant-twice", SWEEP, params_file({"methods": ["snapkv", {"method": "snapkv", "keep": [0.5]}]}),
     "methods[1] repeats keep (snapkv: keep=0.5): list each method variant once"),
    ("set-models-twice", SWEEP + " --set models=[tiny-llama,tiny-llama]", good_params, "models: 'tiny-llama' is listed twice"),
    ("set-ctx-twice", SWEEP + " --set ctx=[32,32]", good_params, "ctx: 32 is listed twice"),
    ("set-batch-twice", SWEEP + " --set batch=[1,1.0]", good_params, "batch: 1.0 is listed twice"),
    ("set-engine-empty", SWEEP + " --set engine=[]", good_params, "engine: empty; list at least one value"),
    ("set-models-empty", SWEEP + " --set models=[]", good_params, "models: empty"),
    ("set-ctx-empty", SWEEP + " --set ctx=[]", good_params, "ctx: empty"),
    ("set-batch-empty", SWEEP + " --set batch=[]", good_params, "batch: empty"),
    ("set-keep-empty", SWEEP + " --set keep=[]", good_params, "keep: empty"),
    ("set-bits-empty", SWEEP + " --set bits=[]", good_params, "bits: empty"),
    ("set-prefill-chunk-empty", SWEEP + " --set prefill_chunk=[]", good_params, "prefill_chunk: empty"),
    ("set-weights-quant-empty", SWEEP + " --set weights_quant=[]", good_params, "weights_quant: empty"),
    ("params-method-keep-empty", SWEEP, params_file({"methods": [{"method": "snapkv", "keep": []}]}), "keep: empty"),
    ("params-quality-lengths-empty", SWEEP, quality_params({"lengths": []}), "quality.lengths: empty"),
    ("set-batch-true", SWEEP + " --set batch=[true]", good_params, "batch: true/false is not a number here"),
    ("set-ctx-true", SWEEP + " --set ctx=true", good_params, "ctx: true/false is not a number here"),
    ("set-keep-true", SWEEP + " --set keep=[true]", good_params, "keep: true/false is not a number here"),
    ("set-new-tokens-true", SWEEP + " --set new_tokens=true", good_params, "new_tokens: true/false is not a number here"),
    ("set-repeats-false", SWEEP + " --set repeats=false", good_params, "repeats: true/false is not a number here"),
    ("set-budget-true", SWEEP + " --set budget_gb=true --set batch=[1,2]", good_params, "budget_gb: true/false"),
    ("params-method-keep-true", SWEEP, params_file({"methods": [{"method": "snapkv", "keep": [True]}]}),
     "keep: true/false is not a number here"),
    ("params-method-knob-true", SWEEP, params_file({"methods": [{"method": "snapkv", "keep": 0.5, "window_size": True}]}),
     "window_size"),
    ("set-ctx-dist-median-true", SWEEP.split() + ["--set", "ctx={dist: lognormal, median: true, sigma: 1}"], good_params,
     "median: true/false is not a number here"),
    ("params-quality-samples-true", SWEEP, quality_params({"samples": True}), "quality.samples: true/false"),
    ("set-duplicate-key-in-a-value", SWEEP.split() + ["--set", "ctx={dist: lognormal, median: 100, median: 200, sigma: 1}"],
     good_params, "gives the key 'median' twice"),
    ("params-streamingllm-sinks-fill-the-cache", SWEEP,
     params_file({"methods": [{"method": "streamingllm", "keep": 0.5, "n_sink": 100}]}),
     "n_sink=100 is more than the 16 tokens keep=0.5 keeps at ctx 32"),
    ("generate-param-duplicate-key", ["generate", "--model", "smollm2-135m", "--prompt", "hi", "--method", "adakv",
                                      "--param", "scorer_params={window_size: 4, window_size: 8}"], None,
     "gives the key 'window_size' twice"),
    ("budget-residual-without-bits", "budget --model llama-3.1-8b --ctx 1024 --residual 64", None,
     "--residual 64: only a quantized cache keeps a 16-bit residual; add --bits 4"),
    ("budget-gpu-empty", ["budget", "--model", "llama-3.1-8b", "--ctx", "1024", "--gpu", ""], None, "--gpu '' names no GPU"),
    ("budget-gpu-and-bandwidth", "budget --model llama-3.1-8b --ctx 1024 --gpu h200 --bandwidth 1000", None,
     "--gpu h200 and --bandwidth: the preset sets bandwidth and memory"),
    ("budget-bandwidth-inf", "budget --model llama-3.1-8b --ctx 1024 --bandwidth inf", None,
     "--bandwidth must be a finite positive number of GB/s, got inf"),
    ("budget-memory-inf", "budget --model llama-3.1-8b --ctx 1024 --memory inf", None, "--memory must be a finite"),
    ("budget-reserve-nan", "budget --model llama-3.1-8b --ctx 1024 --gpu h200 --reserve nan", None, "--reserve must be"),
    ("budget-ctx-dist-duplicate-key", ["budget", "--model", "tiny-llama", "--ctx-dist",
                                       "{dist: lognormal, median: 5, median: 6, sigma: 1}"], None, "gives the key 'median' twice"),
    ("report-records-file-is-a-folder", "report {tmp}/s", lambda t: (t / "s" / "records.jsonl").mkdir(parents=True),
     "s/records.jsonl is a folder, not the records file"),
    ("out-records-file-is-a-folder", SWEEP, lambda t: (good_params(t), (t / "out" / "records.jsonl").mkdir(parents=True)),
     "records.jsonl is a folder, not a records file"),
    # --- serve / loadgen ----------------------------------------------------------------------
    ("serve-model-unknown", "serve --model gpt-9", None, "unknown model 'gpt-9'"),
    ("serve-no-model", "serve --port 8123", None, "no model"),
    ("serve-weights-unknown", "serve --model smollm2-135m --weights fake", None, "argument --weights: invalid choice"),
    ("serve-no-weights", "serve --model llama-3.1-8b", None, "no real weights"),
    ("serve-device-tpu", "serve --model smollm2-135m --device tpu", None, "--device"),
    ("serve-method-unknown", "serve --model smollm2-135m --method h2o", None, "unknown method 'h2o'"),
    ("serve-keep-zero", "serve --model smollm2-135m --method snapkv --keep 0", None, "keep=0"),
    ("serve-bits", "serve --model smollm2-135m --method kvq-int4 --bits 3", None, "nbits"),
    ("serve-group-size", "serve --model smollm2-135m --method kvq-int4 --group-size 48", None, "q_group_size"),
    ("serve-param-unknown", "serve --model smollm2-135m --method snapkv --param nope=1", None, "nope"),
    ("serve-param-twice", "serve --model smollm2-135m --method snapkv --keep 0.5 --param keep=0.5", None,
     "already set by its own flag"),
    ("serve-pool-gb", "serve --model smollm2-135m --pool-gb 0", None, "pool_gb"),
    ("serve-block-size", "serve --model smollm2-135m --block-size 0", None, "block_size"),
    ("serve-max-num-seqs", "serve --model smollm2-135m --max-num-seqs 0", None, "max_num_seqs"),
    ("serve-max-num-batched-tokens", "serve --model smollm2-135m --max-num-batched-tokens -4", None,
     "max_num_batched_tokens"),
    ("serve-port", "serve --model smollm2-135m --port 70000", None, "port 70000"),
    ("serve-host", "serve --model smollm2-135m --host 203.0.113.7", None, "cannot listen there"),
    ("serve-max-in-flight", "serve --model smollm2-135m --max-in-flight 0", None, "max_in_flight"),
    ("serve-params-missing", "serve --params {tmp}/nope.yaml", None, "cannot read it"),
    ("serve-params-unknown-key", "serve --params {tmp}/s.yaml", files({"s.yaml": "model: smollm2-135m\nmethods: [full]\n"}),
     "unknown key(s) methods"),
    ("serve-params-policy", "serve --params {tmp}/s.yaml", files({"s.yaml": "model: smollm2-135m\npolicy: 3\n"}),
     "policy must be a mapping"),
    ("loadgen-target", "loadgen --target localhost:8000", None, "--target 'localhost:8000'"),
    ("loadgen-target-silent", "loadgen --target http://127.0.0.1:9 --requests 1", None, "no OpenAI-compatible server"),
    ("loadgen-requests", "loadgen --target http://127.0.0.1:9 --requests 0", None, "--requests"),
    ("loadgen-rate", "loadgen --target http://127.0.0.1:9 --rate 0", None, "--rate"),
    ("loadgen-input-tokens", "loadgen --target http://127.0.0.1:9 --input-tokens 0", None, "--input-tokens"),
    ("loadgen-output-tokens", "loadgen --target http://127.0.0.1:9 --output-tokens -1", None, "--output-tokens"),
    ("loadgen-model", ["loadgen", "--target", "http://127.0.0.1:9", "--model", " "], None, "--model is empty"),
    ("loadgen-endpoint", "loadgen --target http://127.0.0.1:9 --endpoint embeddings", None, "invalid choice"),
    ("loadgen-vocab-size", "loadgen --target http://127.0.0.1:9 --vocab-size 1", None, "--vocab-size"),
    ("loadgen-seed", "loadgen --target http://127.0.0.1:9 --seed x", None, "argument --seed"),
    ("loadgen-max-concurrency", "loadgen --target http://127.0.0.1:9 --max-concurrency 0", None, "--max-concurrency"),
    ("loadgen-out", "loadgen --target http://127.0.0.1:9 --out {tmp}/f", files({"f": "x"}), "is a file"),
    ("loadgen-server-pid", "loadgen --target http://127.0.0.1:9 --server-pid 999999999", None, "no such process"),
    ("loadgen-gpu", "loadgen --target http://127.0.0.1:9 --gpu tpu", None, "--gpu tpu"),
]


def test_the_table_is_large_and_its_ids_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) >= 195 and len(ids) == len(set(ids))


# Coverage: every sweep key (SweepParams' fields, and a quality block's TaskSpec keys as quality.KEY)
# and every flag of every subcommand has a row above, so a new parameter cannot land without one.
# A row covers the keys its params dict or --set names and the flags its argv gives; the flags
# nearly every row of a command passes count only for a row whose id names them.
ALWAYS_GIVEN = {("sweep", "--out"), ("generate", "--model"), ("generate", "--prompt"), ("generate", "--prompt-tokens"),
                ("quality", "--out"), ("budget", "--model"), ("budget", "--ctx")}
POSITIONAL_ROWS = {("sweep", "params"): "params-missing", ("report", "dir"): "report-missing-folder",
                   ("models", "folders"): "models-folder-missing"}
# what needs no row, and why
EXEMPT_KEYS = {
    "quality.task_params": "per-task knobs, checked by each task (kvlab.tasks) at build time; no common schema",
}


def flags_by_command():
    """{command: {option string or positional dest: canonical name}}, from the CLI's own parsers;
    store_true flags are left out (they take no value, so none can be bad)."""
    import argparse

    from kvlab.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, parser in sub.choices.items():
        names = {}
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.nargs == 0:
                continue
            canonical = max(action.option_strings, key=len) if action.option_strings else action.dest
            for opt in action.option_strings or [action.dest]:
                names[opt] = canonical
        out[name] = names
    return out


def covered(cases):
    """(sweep keys, (command, flag) pairs) the rows cover."""
    by_command = flags_by_command()
    keys, flags = set(), set()
    for case_id, argv, setup, _ in cases:
        args = argv.split() if isinstance(argv, str) else list(argv)
        names = by_command[args[0]]
        keys |= getattr(setup, "keys", set())
        for i, a in enumerate(args[1:], 1):
            if a == "--set" and i + 1 < len(args):
                keys.add(args[i + 1].partition("=")[0].strip())
            if a in names:
                flag = names[a]
                if (args[0], flag) not in ALWAYS_GIVEN or flag.strip("-") in case_id:
                    flags.add((args[0], flag))
        if args[0] == "sweep":  # the flags that set sweep keys
            keys |= {k for f, k in (("--executor", "executor"), ("--ray-address", "ray_address")) if f in args}
    ids = {c[0] for c in cases}
    flags |= {pair for pair, row in POSITIONAL_ROWS.items() if row in ids}
    return keys, flags


def policy_params_covered(cases) -> set[str]:
    """The policy parameters the rows give a value: a method entry's knobs (params files, --set
    methods=..., anatomy --params) and kvlab generate's policy flags."""
    import json

    from kvlab.cli import generate_run

    flag_params = {f"--{flag.replace('_', '-')}": param for flags in (generate_run.EVICTION_FLAGS, generate_run.QUANT_FLAGS,
                                                                     generate_run.DECODING_FLAGS, generate_run.READ_FLAGS)
                   for flag, param in flags.items()}
    flag_params.update({"--backend": "quant", "--prefill-chunk": "prefill_chunk"})
    out = set()

    def entries(methods):
        for entry in methods if isinstance(methods, list) else [methods]:
            if isinstance(entry, dict):
                out.update({"bits": "nbits"}.get(k, k) for k in entry if k != "method")

    for _, argv, setup, _ in cases:
        args = argv.split() if isinstance(argv, str) else list(argv)
        entries(getattr(setup, "methods", None) or [])
        for i, a in enumerate(args[1:], 1):
            if args[0] == "generate" and a in flag_params:
                out.add(flag_params[a])
            if a == "--set" and args[i + 1].startswith("methods="):
                entries(yaml.safe_load(args[i + 1].partition("=")[2]))
            if args[0] == "anatomy" and a == "--params":
                try:
                    for knobs in json.loads(args[i + 1]).values():
                        out.update(knobs)
                except (ValueError, AttributeError):
                    pass
    return out


def test_every_policy_parameter_has_a_bad_input_row():
    """Each parameter of each registered method (kvlab policies), so a new method's knobs get rows."""
    import dataclasses

    from kvlab.policies import POLICIES

    wanted = {f.name for cls in POLICIES.values() for f in dataclasses.fields(cls) if f.init}
    missing = sorted(wanted - policy_params_covered(CASES))
    assert not missing, f"add a row to CASES giving a bad value of: {missing}"


def test_every_sweep_key_and_cli_flag_has_a_bad_input_row():
    from kvlab.quality import TaskSpec
    from kvlab.sweep.params import SweepParams

    keys, flags = covered(CASES)
    wanted = set(SweepParams.model_fields) | {f"quality.{k}" for k in TaskSpec.model_fields}
    missing_keys = sorted(wanted - keys - set(EXEMPT_KEYS))
    missing_flags = sorted(f"{c} {f}" for c, names in flags_by_command().items()
                           for f in set(names.values()) if (c, f) not in flags)
    assert not missing_keys and not missing_flags, (
        f"add a row to CASES (or an EXEMPT_KEYS entry saying why none) for: keys {missing_keys}, flags {missing_flags}")


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: every check must come first."""
    import kvlab.models
    import kvlab.preflight
    import kvlab.report

    def refuse(*args, **kwargs):
        pytest.fail(f"a model was loaded for bad input: load_model{args}")

    def refuse_render(*args, **kwargs):
        pytest.fail("a report was rendered for bad input")

    monkeypatch.setattr(kvlab.models, "load_model", refuse)
    monkeypatch.setattr(kvlab.report, "render_notebook", refuse_render)
    monkeypatch.setattr(kvlab.preflight, "available_memory_bytes", lambda device: 64 * 1024**3)  # any machine


@pytest.mark.parametrize("case_id, argv, setup, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_clear_line_and_exit_2(case_id, argv, setup, expected, tmp_path, capsys,
                                                   no_model_load, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        setup(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in (argv.split() if isinstance(argv, str) else argv)]
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own checks (a type, a choice): the same one line
        code = exit_.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}; stderr: {err}"
    assert len(lines) == 1 and lines[0].startswith(f"kvlab {args[0]}: error: "), err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert not (tmp_path / "out").exists() or case_id.startswith("out-")  # no sweep folder for bad params


def test_cuda_without_a_gpu_is_one_line_before_any_load(tmp_path, capsys, no_model_load, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.chdir(tmp_path)
    good_params(tmp_path)
    for argv in (["generate", "--model", "smollm2-135m", "--prompt", "hi", "--device", "cuda"],
                 ["anatomy", "--device", "cuda"], ["quality", "-o", "q", "--device", "cuda"],
                 ["sweep", "p.yaml", "-o", "out", "--set", "device=cuda"]):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "torch sees no CUDA device" in lines[0], lines


def test_damaged_records_are_skipped_on_resume_and_in_the_report_data(tmp_path, capsys):
    """Non-object lines, non-string run ids, invalid UTF-8 and torn lines: each skipped with a
    warning naming the file and line; the sweep resumes (exit 0) and load_records reads the rest."""
    from kvlab.records import load_records, read_records

    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({**GOOD, "methods": ["full"], "name": "dmg"}))
    out = tmp_path / "out"
    assert main(["sweep", str(params), "-o", str(out), "--no-progress"]) == 0
    good = (out / "records.jsonl").read_bytes()
    damage = b'123\nnull\n"x"\n[1, 2]\n{"run_id": 5, "status": "ok"}\n{"run_id": null}\n\xff\xfe bad\n{"run_id": "t'
    (out / "records.jsonl").write_bytes(damage + b"\n" + good)
    with pytest.warns(UserWarning) as caught:
        assert main(["sweep", str(params), "-o", str(out), "--no-progress"]) == 0
        df = load_records(out)
    messages = [str(w.message) for w in caught]
    assert any("records.jsonl:1: skipped a line that is not a JSON object (int)" in m for m in messages)
    assert any("records.jsonl:7: skipped a line that is not UTF-8" in m for m in messages)
    assert any("run_id is 5, not a string" in m for m in messages)
    assert "status complete" in capsys.readouterr().out
    assert len(df) == 1 and df.status.tolist() == ["ok"]  # nothing reran, nothing lost
    with pytest.warns(UserWarning):
        assert [r["run_id"] for r in read_records(out / "records.jsonl")] == [df.run_id.iloc[0]]


def test_params_error_with_several_problems_lists_them(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "ctx": 5000, "methods": ["h2o"]}))
    assert main(["sweep", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab sweep: error: invalid sweep params:\n")
    assert "unknown method 'h2o'" in err and "above the maximum context" in err and "Traceback" not in err


def test_report_refuses_an_unrelated_folder_without_writing_into_it(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("# mine")
    assert main(["report", str(tmp_path)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]
    assert capsys.readouterr().err.count("\n") == 1


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    import kvlab.cli.budget_cmd as budget_cmd

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(budget_cmd, "run", interrupted)
    assert main(["budget", "--model", "tiny-llama", "--ctx", "8"]) == 130
    assert capsys.readouterr().err.strip() == ("kvlab budget: interrupted; every record written so far is kept "
                                               "(rerun to continue)")


def test_every_stored_width_passes_the_byte_arithmetic():
    """The memory preflight's bit widths cover every backend's (hqq's 3 bits was refused, #31)."""
    from kvlab.budget import SUPPORTED_BITS
    from kvlab.policies.quantized import BACKENDS

    assert {b for backend in BACKENDS.values() for b in backend.nbits} <= set(SUPPORTED_BITS)


def test_hqq_3_bits_runs_in_generate_and_passes_a_sweeps_checks(tmp_path, capsys):
    """The valid case of #31's regression: tiny-llama, synthetic weights, CPU, 3-bit hqq past its residual."""
    pytest.importorskip("hqq")
    from kvlab.sweep.params import parse_params
    from kvlab.sweep.plan import planned_runs

    assert main(["generate", "--model", "tiny-llama", "--weights", "synthetic", "--prompt-tokens", "24",
                 "--method", "hqq", "--bits", "3", "--group-size", "16", "--residual", "4",
                 "--max-new-tokens", "2", "--json"]) == 0
    assert '"nbits": 3' in capsys.readouterr().out
    params = parse_params({**GOOD, "methods": [{"method": "hqq", "bits": [3], "q_group_size": 16}]})
    assert len(planned_runs(params, check_device=True)) == 1


def test_generate_takes_decodings_target_interval_and_score(capsys):
    """#31: the flags reach the policy (its label says target/interval and the score)."""
    assert main(["generate", "--model", "tiny-llama", "--weights", "synthetic", "--prompt-tokens", "24",
                 "--method", "decoding", "--target", "8", "--interval", "4", "--score", "knorm",
                 "--max-new-tokens", "6", "--json"]) == 0
    assert '"label": "decoding knorm 8/4"' in capsys.readouterr().out


def test_a_ray_address_that_does_not_answer_is_refused_within_its_timeout(monkeypatch):
    """Nothing listening (refused at once), nothing answering (the connect's timeout) or a port that is
    no Ray head (no gRPC reply within the timeout): one line each, bounded. A live head answers (checked
    by hand against ray.init's GCS: its SETTINGS frame)."""
    import socket
    import time

    from kvlab.sweep import ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = time.monotonic()
    assert ray_address.address_problem("127.0.0.1:9", timeout_s=0.5).startswith(
        "ray_address: nothing answers at 127.0.0.1:9 (connection refused)")
    assert time.monotonic() - started < 3
    asked = []

    def silent(address, timeout):
        asked.append((address, timeout))
        raise TimeoutError

    with socket.create_server(("127.0.0.1", 0)) as listener:  # takes the connection, never speaks gRPC
        port = listener.getsockname()[1]
        started = time.monotonic()
        problem = ray_address.address_problem(f"127.0.0.1:{port}", timeout_s=0.5)
        assert time.monotonic() - started < 3
    assert problem.startswith(f"ray_address: 127.0.0.1:{port} takes a connection but does not answer as a Ray head")

    monkeypatch.setattr(socket, "create_connection", silent)
    assert "(no answer within 0.5 s)" in ray_address.address_problem("ray://head:10001", timeout_s=0.5)
    assert asked == [(("head", 10001), 0.5)]
    assert ray_address.address_problem("auto") is None and ray_address.address_problem(None) is None
