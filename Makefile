# make test / make demo work on a fresh machine: they build .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# The CPU build of torch lies in /opt/wheels on this workplace's machines;
# elsewhere pip's own index serves it.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
ARGS ?=
# The dashboard's browser test drives Debian's chromium (never a downloaded browser);
# `make test` installs it where it is missing (apt-get, as root), so a fresh machine needs nothing by hand.
CHROMIUM := /usr/bin/chromium
# tests/dashboard/test_promtool.py lints /metrics with promtool, from Debian's prometheus package (same rule).
PROMTOOL := /usr/bin/promtool
# tests/netns partitions silos with `ip netns` and `tc netem` (Debian's iproute2): installed
# the same way. They need root anyway, so without root make test goes on and they say why.
IPROUTE := /usr/sbin/tc
# The Redis Cluster tests create their 3-master cluster with `redis-cli --cluster create`
# (silo/testing/redis_cluster.py): Debian's redis-tools, installed the same way.
REDIS_CLI := /usr/bin/redis-cli
# tests/grains/serving/test_http2_attacks.py floods the gRPC front with h2load, from Debian's nghttp2-client (same rule).
H2LOAD := /usr/bin/h2load

.PHONY: install test demo bench soak sim lint typecheck clean partition-test proto

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools
	$(PIP) install -q $(FIND_LINKS) -c constraints.txt torch==2.13.0
	$(PIP) install -q $(FIND_LINKS) -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

$(CHROMIUM):
	@if [ "$$(id -u)" != 0 ]; then echo "the browser test needs Debian's chromium: run 'sudo apt-get install -y chromium'" >&2; exit 1; fi
	DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

$(PROMTOOL):
	@if [ "$$(id -u)" != 0 ]; then echo "the metrics lint test needs Debian's promtool: run 'sudo apt-get install -y --no-install-recommends prometheus'" >&2; exit 1; fi
	DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null

$(REDIS_CLI):
	@if [ "$$(id -u)" != 0 ]; then echo "the Redis Cluster tests need redis-cli: run 'sudo apt-get install -y redis-tools'" >&2; exit 1; fi
	DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-tools >/dev/null

$(H2LOAD):
	@if [ "$$(id -u)" != 0 ]; then echo "the HTTP/2 attack tests need h2load: run 'sudo apt-get install -y --no-install-recommends nghttp2-client'" >&2; exit 1; fi
	DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nghttp2-client >/dev/null

$(IPROUTE):
	@if [ "$$(id -u)" != 0 ]; then echo "note: the network-partition tests need root and Debian's iproute2; they will not run" >&2; \
	else DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null; fi

# The tests start a few hundred Python processes (silos, samples, CLIs). Each would compile the
# project's modules again where PYTHONDONTWRITEBYTECODE is set (it is on this workplace's
# machines): compiled once here, every process reads the bytecode (0.2-0.3 s a process).
# The 30 slowest tests are listed at the end of every run: make test must stay under 20 minutes,
# and what grows it shows there (a long one belongs behind make soak / sim / bench).
test: $(STAMP) $(CHROMIUM) $(PROMTOOL) $(REDIS_CLI) $(H2LOAD) $(IPROUTE)
	$(PY) -m compileall -q -j 0 grains silo dashboard benchmarks samples tests >/dev/null
	$(PY) -m pytest -q -m "not soak" --durations=30 $(ARGS)

demo: $(STAMP)
	$(VENV)/bin/redgrain demo $(ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks all $(ARGS)

# The simulator's long soak: many thousands of seeded clusters (make test runs 200), then the
# services scenario (reminders, timers, streams on the fakeredis twin; make test runs 30), and
# the silo and stops scenarios (the production Silo class on fakeredis, ~1-2 s a seed; make test
# runs 12 and 2).
# A failing seed prints its replay command; SEEDS=1-500, SERVICE_SEEDS=1-100, SILO_SEEDS=1-50 run fewer.
SEEDS ?= 1-5000
SERVICE_SEEDS ?= 1-1000
SILO_SEEDS ?= 1-500
sim: $(STAMP)
	$(PY) -m silo.testing.sim run --seeds $(SEEDS) --jobs 2 --shrink $(ARGS)
	$(PY) -m silo.testing.sim run --seeds $(SERVICE_SEEDS) --scenario services --jobs 2 --shrink $(ARGS)
	$(PY) -m silo.testing.sim run --seeds $(SERVICE_SEEDS) --scenario results --jobs 2 --shrink $(ARGS)
	$(PY) -m silo.testing.sim run --seeds $(SERVICE_SEEDS) --scenario versions --jobs 2 --shrink $(ARGS)
	$(PY) -m silo.testing.sim run --seeds $(SILO_SEEDS) --scenario silo --jobs 2 --shrink $(ARGS)
	$(PY) -m silo.testing.sim run --seeds $(SILO_SEEDS) --scenario stops --jobs 2 --shrink $(ARGS)

soak: $(STAMP)
	$(PY) -m pytest -q -s -m soak tests/chaos tests/grains/training/test_resume_matrix.py tests/grains/training/test_async_converges.py $(ARGS)

# Long forms of the partition scenarios (silos on separate network namespaces; needs root).
# The short forms run in `make test`, but the training run over slow links (both of its forms
# run here). Figures: REDGRAIN_PARTITION_REPORT=path.jsonl.
partition-test: $(STAMP)
	$(PY) -m pytest -q -s -m "netns and soak" tests/netns $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check grains silo dashboard
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The gRPC front's messages and stubs, generated from the committed .proto and committed too (a fresh
# install needs no protoc). The sed moves the messages into a pool of their own: tritonclient's
# grpc_service.proto defines the same `inference.*` names in protobuf's default pool, and two files
# defining one name there fail to import in one process (docs/decisions.md says more).
PROTO := grains/serving/proto/grpc_predict_v2
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO).proto
	sed -i 's/_descriptor_pool\.Default()\.AddSerializedFile(/_descriptor_pool.DescriptorPool().AddSerializedFile(/' $(PROTO)_pb2.py
	grep -q '_descriptor_pool.DescriptorPool().AddSerializedFile(' $(PROTO)_pb2.py

clean:
	rm -rf $(VENV) .redgrain .pytest_cache
