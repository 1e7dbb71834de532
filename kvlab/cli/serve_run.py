"""`kvlab serve`'s work: the config from the params file and flags, every check before the model
loads, then the engine and the HTTP server until interrupted."""

from __future__ import annotations

import logging
import socket

from kvlab import models
from kvlab.api.config import make_config, read_params_file
from kvlab.api.server import make_app, run_server
from kvlab.cli.generate_run import param_overrides
from kvlab.errors import UserError
from kvlab.loadgen.meter import nvml_reader
from kvlab.policies import make_policy
from kvlab.preflight import device_problem, require, weights_problem
from kvlab.serve.engine import make_serving_engine

FLAG_POLICY = {"keep": "keep", "bits": "nbits", "group_size": "q_group_size"}
FLAG_CONFIG = ("model", "weights", "device", "method", "pool_gb", "block_size", "max_num_seqs", "max_num_batched_tokens",
               "host", "port", "max_in_flight")


def config_from_args(args):
    policy = {param: getattr(args, flag) for flag, param in FLAG_POLICY.items() if getattr(args, flag) is not None}
    for key, value in param_overrides(args.param).items():
        if key in policy:
            raise UserError(f"--param {key}: {key} is already set by its own flag; give it once")
        policy[key] = value
    file_values = read_params_file(args.params) if args.params else {}
    return make_config(file_values, {**{k: getattr(args, k) for k in FLAG_CONFIG}, "policy": policy})


def listen_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (taken, not this machine's address), or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as err:
        return f"--host {host} --port {port}: cannot listen there ({err.strerror or err}); pick another"
    return None


def serve(args) -> int:
    config = config_from_args(args)
    models.get_spec(config.model)  # an unknown model: one line, nothing loaded
    make_policy(config.method, **config.policy)  # a bad method or parameter: the same
    require(device_problem(config.device), weights_problem(config.model, config.weights),
            listen_problem(config.host, config.port))
    logging.basicConfig(level=logging.INFO, format="kvlab serve: %(message)s")
    loaded = models.load_model(config.model, weights=config.weights, device=config.device)
    engine = make_serving_engine(loaded, config.method, **config.engine_options(), **config.policy)
    engine.warm_up()
    counter = nvml_reader(config.device) if config.device.startswith("cuda") else None
    app = make_app(engine, method=config.method, energy_j=counter.read if counter else (lambda: None),
                   max_in_flight=config.max_in_flight)
    logging.getLogger("kvlab.api").info("%s with %s on http://%s:%d", engine.model_name, config.method,
                                        config.host, config.port)
    run_server(app, config.host, config.port)
    return 0
