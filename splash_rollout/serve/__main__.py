"""``python -m splash_rollout.serve [overrides]``: the OpenAI-compatible server.

Composes ``conf/serve.yaml`` -- the recipe's ``model``, ``engine`` and ``hardware`` groups and the
``serve`` group -- builds the engine (spawning its ranks), or with ``engine.fleet.replicas`` > 1 a
fleet of engines placed by Ray, and serves it with uvicorn until SIGINT or SIGTERM: then new
requests are refused, those in flight get ``serve.drain_timeout_s`` to finish, the rest are aborted,
and the ranks (replicas) end with the server.

    python -m splash_rollout.serve                                   # glm5-nano on 2 CPU ranks, port 8000
    python -m splash_rollout.serve serve.port=8001 engine.parallel.world_size=1 model.path=/models/ckpt
    python -m splash_rollout.serve engine.fleet.replicas=2 engine.parallel.world_size=1   # two replicas (Ray)
    python -m splash_rollout.serve --cfg [overrides]                 # print the composed config, every field
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

try:
    import hydra  # noqa: F401
    from omegaconf import DictConfig, OmegaConf
except ModuleNotFoundError as e:  # the engine installs without the Hydra stack
    raise ModuleNotFoundError(f"python -m splash_rollout.serve needs Hydra ({e.name} is not installed): "
                              f"pip install \"splash_rollout[rl,serve]\"", name=e.name) from e

from splash_rollout.conf import CONFIG_DIR as CONF_DIR  # noqa: E402
from splash_rollout.recipes.engine_config import register_engine_fields  # noqa: E402

register_engine_fields()


def serve_config(cfg: DictConfig):
    from splash_rollout.serve.app import ServeConfig

    given = {k: v for k, v in OmegaConf.to_container(cfg.serve, resolve=True).items() if v is not None}
    return ServeConfig(**given)


def run(cfg: DictConfig) -> None:
    try:
        import uvicorn
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"python -m splash_rollout.serve needs the server stack ({e.name} is not "
                                  f"installed): pip install \"splash_rollout[serve]\"", name=e.name) from e
    from splash_rollout.recipes.engine_config import build_engine_or_fleet, engine_config
    from splash_rollout.rollout.process_settings import freeze_heap
    from splash_rollout.serve.app import drain, make_app

    config = serve_config(cfg)
    backend = build_engine_or_fleet(cfg, engine_config(cfg))  # a RolloutEngine or a Fleet
    app = make_app(backend, config)
    freeze_heap()  # this process holds only the server: see process_settings
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           timeout_graceful_shutdown=max(1, int(config.drain_timeout_s) + 5)))
    http = threading.Thread(target=server.run, name="splash-http", daemon=True)

    def end_serving() -> None:  # after the drain: the loop hands back what it aborted, then stops
        backend.stop_serving()

    def on_signal(sig, frame) -> None:  # refuse new work, drain in the HTTP thread, then stop serving
        if app.state.server.draining:
            return
        app.state.server.draining = True
        loop = getattr(server, "splash_event_loop", None)
        if loop is not None and loop.is_running():
            future = asyncio.run_coroutine_threadsafe(drain(app.state.server, config.drain_timeout_s), loop)
            future.add_done_callback(lambda _: threading.Thread(target=end_serving, daemon=True).start())
        else:
            threading.Thread(target=end_serving, daemon=True).start()

    def started() -> None:  # the loop accepts requests: open the port
        original_startup = server.startup

        async def startup(sockets=None):
            server.splash_event_loop = asyncio.get_running_loop()
            await original_startup(sockets=sockets)

        server.startup = startup
        http.start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    replicas = len(backend.replica_states())
    print(f"splash_rollout: serving {app.state.server.model_name!r} on http://{config.host}:{config.port}/v1 "
          f"({replicas} engine(s) of {backend.config.parallel.world_size} rank(s), layout "
          f"{backend.config.parallel.layout})", flush=True)
    try:
        # One engine computes in this thread (the one that built it: see RolloutEngine.serve_here); a
        # fleet's replicas compute in their own processes and this thread waits. HTTP is answered in another.
        backend.serve_here(ready=started)
    finally:
        server.should_exit = True
        if http.is_alive():
            http.join(max(5.0, config.drain_timeout_s + 10))
        backend.shutdown()


def main(argv: list[str] | None = None) -> None:
    from hydra import compose, initialize_config_dir

    args = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(args):
        print(__doc__)
        return
    show = "--cfg" in args  # print the composed config (every engine.<group>.<field> with its value) and exit
    overrides = [a for a in args if a != "--cfg"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="serve", overrides=overrides)
    if show:
        print(OmegaConf.to_yaml(cfg))
        return
    run(cfg)


if __name__ == "__main__":
    main()
