"""The ``kaitian`` commands that look into a running graph (``node``, ``topic``, ``param``) and
``kaitian bag``: each reaches the graph through a GraphClient on the router."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import yaml

from kaitian_ros.cli_error import CliError


def message_to_data(msg: Any, max_array: int | None = 16) -> Any:
    """Plain YAML-able data of a rosbags message (long arrays elided like ``ros2 topic echo --no-arr``)."""
    if hasattr(msg, "__dataclass_fields__"):
        return {k: message_to_data(getattr(msg, k), max_array) for k in msg.__dataclass_fields__
                if not k.isupper() and k != "__msgtype__"}
    if isinstance(msg, np.ndarray):
        if max_array is not None and msg.size > max_array:
            return f"<array type: {msg.dtype}, length: {msg.size}>"
        return msg.tolist()
    if isinstance(msg, (list, tuple)):
        if max_array is not None and len(msg) > max_array:
            return f"<sequence length: {len(msg)}>"
        return [message_to_data(m, max_array) for m in msg]
    if isinstance(msg, np.generic):
        return msg.item()
    return msg


def _client(args: argparse.Namespace) -> Any:
    from kaitian_ros.runtime.graph_client import GraphClient, GraphError

    try:
        return GraphClient(args.router)
    except GraphError as exc:
        raise CliError(str(exc), 1) from None


def cmd_node(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for name in client.nodes():
            print(name)
    return 0


def cmd_topic(args: argparse.Namespace) -> int:
    from kaitian_ros.runtime.graph_client import GraphError, RateMeter

    with _client(args) as client:
        if args.topic_cmd == "list":
            for info in client.topics():
                print(f"{info.name} [{', '.join(info.types)}]" if args.show_types else info.name)
            return 0
        topic = args.topic if args.topic.startswith("/") else "/" + args.topic
        try:
            msg_type = args.type or client.topic_type(topic)
        except GraphError as exc:
            raise CliError(str(exc), 1) from None
        done = threading.Event()
        if args.topic_cmd == "echo":
            count = {"n": 0}
            lock = threading.Lock()

            def show(msg: Any, size: int) -> None:
                with lock:
                    if done.is_set():
                        return
                    if msg is None:
                        print(f"# undecodable {size}-byte payload dropped", file=sys.stderr)
                        return
                    print(yaml.safe_dump(message_to_data(msg, None if args.full_arrays else 16),
                                         sort_keys=False).rstrip())
                    print("---", flush=True)
                    count["n"] += 1
                    if args.once or (args.count and count["n"] >= args.count):
                        done.set()

            sub = client.subscribe(topic, msg_type, show)
        else:
            meter = RateMeter(args.window)
            sub = client.subscribe(topic, msg_type, lambda msg, size: meter.tick(size))
        deadline = time.monotonic() + args.timeout if args.timeout else None
        try:
            while not done.is_set():
                done.wait(1.0)
                if args.topic_cmd == "hz":
                    stats = meter.summary()
                    if stats:
                        print(f"average rate: {stats['rate']:.3f}\n\tmin: {stats['min']:.3f}s "
                              f"max: {stats['max']:.3f}s std dev: {stats['std']:.5f}s "
                              f"window: {stats['window']}", flush=True)
                if deadline is not None and time.monotonic() >= deadline:
                    break
        except KeyboardInterrupt:
            pass
        del sub
    return 0


def _format_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def cmd_param(args: argparse.Namespace) -> int:
    from kaitian_ros.runtime.graph_client import GraphError
    from kaitian_ros.runtime.node_args import parse_value

    node = args.node if args.node.startswith("/") else "/" + args.node
    with _client(args) as client:
        try:
            if args.param_cmd == "list":
                print(f"{node}:")
                for p in client.list_parameters(node):
                    print(f"  {p['name']}")
            elif args.param_cmd == "describe":
                for p in client.list_parameters(node):
                    if p["name"] == args.name:
                        print(yaml.safe_dump(p, sort_keys=False).rstrip())
                        return 0
                raise CliError(f"parameter '{args.name}' not declared on {node}", 1)
            elif args.param_cmd == "get":
                value = client.get_parameter(node, args.name)
                kind = {bool: "Boolean", int: "Integer", float: "Double", str: "String"}.get(type(value), "Array")
                print(f"{kind} value is: {_format_value(value)}")
            elif args.param_cmd == "set":
                ok, reason = client.set_parameters(node, {args.name: parse_value(args.value)})
                if not ok:
                    print(f"Setting parameter failed: {reason}", file=sys.stderr)
                    return 1
                print("Set parameter successful")
            elif args.param_cmd == "dump":
                values = {p["name"]: p["value"] for p in client.list_parameters(node)}
                print(yaml.safe_dump({node: {"ros__parameters": values}}, sort_keys=False).rstrip())
        except GraphError as exc:
            raise CliError(str(exc), 1) from None
    return 0


def cmd_bag(args: argparse.Namespace) -> int:
    from kaitian_ros.runtime import bag

    if args.bag_cmd == "info":
        try:
            info = bag.read_info(args.bag)
        except bag.BagError as exc:
            raise CliError(f"kaitian bag info: {exc}", 1) from None
        print(format_bag_info(info))
        return 0
    if args.duration is not None and not args.duration > 0:
        raise CliError(f"kaitian bag record: --duration must be > 0, got {args.duration}")
    output = args.output or bag.default_output()
    if output.exists() or output.is_symlink():  # before connecting: the commonest mistake, said at once
        raise CliError(f"kaitian bag record: {output} exists already (a bag is never overwritten: "
                       "choose another -o)")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with _client(args) as client:
            recorder = bag.Recorder(client, output, args.topics, include_chunks=args.include_chunks,
                                    log=lambda line: print(line, flush=True))
            try:
                topics = recorder.start()
                names = ", ".join(t.name for t in topics) or "none yet"
                print(f"recording {len(topics)} topic{'' if len(topics) == 1 else 's'} to {output} (Ctrl-C to stop): "
                      f"{names}", flush=True)
                summary = recorder.run(stop, args.duration)
            except bag.BagError as exc:
                raise CliError(f"kaitian bag record: {exc}", 1) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    counts = ", ".join(f"{topic} {n}" for topic, n in summary.counts) or "no topics"
    print(f"recorded {summary.total} messages in {summary.duration_s:.1f} s to {summary.path}: {counts}", flush=True)
    return 0


def format_bag_info(info: Any) -> str:
    """``ros2 bag info``'s layout."""
    def stamp(ns: int) -> str:
        when = time.strftime("%b %d %Y %H:%M:%S", time.localtime(ns / 1e9))
        return f"{when}.{ns // 1_000_000 % 1000:03d} ({ns / 1e9:.3f})"

    size = info.size_bytes
    shown = next(f"{size / 1024 ** k:.1f} {unit}" for k, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB"), (0, "B"))
                 if size >= 1024 ** k or k == 0)
    lines = [f"Files:             {', '.join(info.files)}",
             f"Bag size:          {shown}",
             f"Storage id:        {info.storage}",
             f"Duration:          {info.duration_ns / 1e9:.3f}s"]
    if info.message_count:
        lines += [f"Start:             {stamp(info.start_ns)}",
                  f"End:               {stamp(info.start_ns + info.duration_ns)}"]
    lines.append(f"Messages:          {info.message_count}")
    for i, t in enumerate(info.topics):
        head = "Topic information: " if i == 0 else " " * 19
        lines.append(f"{head}Topic: {t.name} | Type: {t.msg_type} | Count: {t.count} | "
                     f"Serialization Format: cdr{' | latched' if t.latched else ''}")
    if not info.topics:
        lines.append("Topic information:")
    return "\n".join(lines)
