"""The HTTP gateway (`laya-pool api`, `laya-pool up --api`): the SDK server's API (`laya serve` 0.4.15:
`POST /v1/systemone`, `POST /v1/systemone/batch`, `GET /health`) in front of a pool, for callers in other languages.

A pool client like any other: it may import the client room and the protocol, nothing else of ours (neither the
broker nor the worker; tests/test_imports.py), and never torch or the SDK. Its HTTP stack (FastAPI, uvicorn) comes
with the server extra; the client install stays without it.

    limits.py   laya serve's bounds and checks, its status codes and detail texts (pure)
    naming.py   which checkpoint a request names, the `routing` block (pure)
    calls.py    a request body -> the pool call and its routing, checked in laya serve's order (pure)
    jev.py      `x_jev_confidence` and the strict Jev projection (pure)
    options.py  the configuration and `laya-pool api`'s flags
    app.py      the FastAPI app: auth, admission, body reading, the pool call, errors as HTTP answers, /health
    server.py   uvicorn with the connection bounds; the process
"""
