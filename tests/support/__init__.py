"""What the tests share; no tests live here. Each module, by what it is for:

Configs and processes
    config            the one config builder (`supervisor_config`; `dataplane_config`, `daemon_config` on top of it),
                      the embedded default, TOML config files, the fake model MODEL and the windows tests run under
    fakes             `fake_command`: the command line of trio_gpuworker.testing's fake engine process
    state             the session's state directory (kernel and JIT caches) and short-path directories
    helpers           `wait_until`, the MiniLM tokenizer, a daemon with an HTTP client, a client hanging up mid-stream
    supervision       rows for fake workers and their expected vectors, waits on a lane's worker, `pid_alive`
    serving           a real in-process daemon serving generate models, for the completion routes' tests
    daemon_process    a real `gpuworkerd` process serving a tiny GGUF, for synchronous client tests
    fake_systemd      a NOTIFY_SOCKET that records what sd_notify sends
    metrics           /metrics read back with prometheus_client's parser
    hostile_traffic   normal and hostile HTTP requests from a process of their own (`python -m`)

Protocol
    proto_connection  feeding the sans-I/O Connection by hand: control frames, expected Messages, feeds
    proto_handshake   HELLO fields, HELLO Messages and the daemon's acceptance rules
    lifecycle_world   a stand-in for the trio lane around the pure LaneLifecycle, walked event by event
    http_fuzz         the HTTP fuzz tests' strategies and one in-process ASGI request

Models and kernels
    reference_llama   an independent numpy llama decoder and the SmolLM2 GGUF's path
    reference_bert    an independent numpy BERT encoder
    tiny_gguf         tiny random llama GGUF files; tiny_vocab their vocabularies (BPE, SentencePiece)
    tiny_encoders     tiny random encoder folders as sentence-transformers saves them
    tiny_bert         a tiny random BERT checkpoint and a daemon config serving it
    tiny_cross_encoder  tiny random cross-encoders and transformers' outputs for them
    engine_example    docs/engines.md's example engine, read from the page
    ckernels          C kernels built as shared libraries and called through ctypes; kernels/ holds the test probes
    jit_restore_child child processes that build and restore JIT-cached models (`python -m`)

Deployment
    deploy_helpers    what the deploy tests read from deploy/ (Containerfile, rendered variants, the pod)
    kustomize_subset  the subset of kustomize the manifests use
    pod_sandbox       a pod's mount namespace for the daemon, run by path as root
"""
