import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    delay = float(msg.content["q"].get("reply-delay", 0.0))
    if delay:
        time.sleep(delay)
    node = {str(k): v for k, v in context.node_config.items()}
    return Message(RecordDict({"r": ConfigRecord(node)}), reply_to=msg)
