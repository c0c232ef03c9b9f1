# The three commands of the README. Everything runs from the project venv (.venv).
PY := .venv/bin/python

.PHONY: setup setup-ci test test-slow demo protos

setup:            ## venv + deps + protobuf code + embedded models (one-time, ~10 min)
	./scripts/setup.sh

setup-ci:         ## as setup, without the embedded models (tests use tiny in-process models)
	SPECDEC_SKIP_MODELS=1 ./scripts/setup.sh

test:             ## fast suite (no GPU, tiny random models, real gRPC servers on 127.0.0.1)
	$(PY) -m pytest -q

test-slow:        ## real-model tests on the embedded pair
	$(PY) -m pytest -q -m slow

demo:             ## all three services locally on the embedded pair, streams a generation
	.venv/bin/specdec demo

protos:           ## regenerate specdec/v1/*_pb2*.py from protos/
	$(PY) scripts/gen_protos.py
