"""`edgellama serve`'s application: the OpenAI HTTP API over one loaded model.

    app = create_app(llm, api_key=None, queue_size=16, parallel=None,   # a Starlette (ASGI) app
                     drafter=None)

One model, `parallel` slots (each a Sequence: its own KV cache), one engine thread:
requests are validated and tokenized on arrival (so a bad one fails at once, without
queueing), then take a free slot or wait in a bounded queue; a full queue answers 503.
The engine decodes one token for every running request in one pass over the weights
(continuous batching, see Engine), and reads new prompts a chunk at a time between those
steps. The model is not thread-safe, so only the engine's thread runs it; the event loop
parses requests and passes text on, so it answers /health and refuses bad requests while
replies are being generated.

The modules (llama.cpp's server splits the same way: server-task, server-context,
server-http):
- params.py: what a client sends, checked: ApiError (an error answer), the body (JSON,
  its size and nesting), each field, and Params (what a request asks of the engine).
- job.py: one request's generation: Job (its Generation, the events it sends),
  StopMatcher. The per-token step is generation.step's, as LLM.generate's.
- engine.py: the thread that runs the model: Engine (slots, continuous batching, prefix
  reuse, slot files and spilling, speculative decoding), Slot.
- app.py: the HTTP side: create_app (the Starlette app, its routes and error handlers),
  Server (the endpoints' handlers), streaming as server-sent events.
- guard.py: the middleware in front of it all: Host and Origin checks, the API key.
- fleet.py: `serve --ray-replicas`: the app as replicas of a Ray Serve deployment
  (Ray is an optional extra; nothing else imports this module).
- anthropic.py: Anthropic's Messages API (/v1/messages) translated onto the same request
  path: its fields to params.py's, the job's events to its reply and stream.
A new endpoint is a Server method and a Route in app.py, with its fields' checks in
params.py.

Hostile input (tests/server/test_server_hostile.py, tests/server/test_fuzz_server.py): every field's JSON
type and range is checked, a wrong one answered 400 naming it; bodies must be JSON (415);
Host and Origin headers are checked against DNS rebinding and cross-site requests
(_Guard: 403); stopping the server ends waiting and running requests with 503
(Engine.shutdown). No request gets a 500 or a traceback in the log. Every walk over
what a client sends is bounded: a body's fields nest at most MAX_BODY_DEPTH levels (and
schemas, tools' parameters and calls' arguments constrain.MAX_DEPTH).
"""
from .app import create_app
from .guard import LOOPBACK_HOSTS, host_name, normalize_origin

__all__ = ["LOOPBACK_HOSTS", "create_app", "host_name", "normalize_origin"]
