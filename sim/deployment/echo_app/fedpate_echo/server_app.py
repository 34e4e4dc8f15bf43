import json
import os
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    expected = int(cfg["expected-nodes"])
    t0 = time.monotonic()
    deadline = t0 + float(cfg["wait-seconds"])
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
        nodes = sorted(grid.get_node_ids())
    settle = time.monotonic() + float(cfg["settle-seconds"])   # give extra (e.g. refused) nodes a chance
    while time.monotonic() < settle:
        time.sleep(0.5)
        nodes = sorted(grid.get_node_ids())
    waited = time.monotonic() - t0
    if bool(cfg["fail"]):
        raise RuntimeError("echo app asked to fail")
    messages = [Message(RecordDict({"q": ConfigRecord({"reply-delay": float(cfg["reply-delay"])})}),
                        dst_node_id=node, message_type="query") for node in nodes]
    replies = list(grid.send_and_receive(messages, timeout=float(cfg["reply-timeout"])))
    result = {"nodes": nodes, "waited-seconds": waited, "replies": [], "errors": []}
    for reply in replies:
        src = reply.metadata.src_node_id
        if reply.has_error():
            result["errors"].append({"node-id": src, "error": str(reply.error.reason)})
        else:
            result["replies"].append({"node-id": src, "node-config": dict(reply.content["r"])})
    out = str(cfg["result-file"])
    if out:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, out)
