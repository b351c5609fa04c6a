"""PD router: an OpenAI-compatible front that sends each request to a prefill and a
decode server (`python -m pdserve.router --pd-disaggregation --prefill URL [PORT]
--decode URL`), or balances over colocated servers (`--worker-urls URL ...`).

Importing it does not import torch: the router runs on a machine without the model."""
