# The two commands a fresh machine needs: `make run` and `make test` (see README.md).
BUILD_DIR ?= build
JOBS ?= 2
export BUILD_DIR JOBS

# The main job: 2 workers on loopback, Fashion-MNIST, the CNN, one epoch.
RUN_ARGS ?= launch --workers 2 -- flotilla train --model cnn --dataset fashion-mnist --epochs 1

.PHONY: all bootstrap bootstrap-test build build-run run test fuzz bench-threads bench-data bench-allreduce bench-peers bench-max-pool-relu bench-batch-norm-relu bench-winograd bench-kernel-choice bench-dropout bench-attention bench-link bench-plan bench-profile bench-recipe bench-batchnorm bench-torchscript bench-elastic bench-scale bench-stragglers bench-chaos bench-gpu package-deb clean

all: build

# What the main job needs (compiler, libraries, LibTorch, the dataset), then what the tests add.
bootstrap:
	@scripts/bootstrap

bootstrap-test:
	@scripts/bootstrap --test

# The library and the CLI only: `make run` builds no test, example or benchmark.
build-run: bootstrap
	@scripts/build --run

# Everything: library, CLI, examples, benchmarks, tests.
build: bootstrap-test
	@scripts/build

run: build-run
	$(BUILD_DIR)/flotilla $(RUN_ARGS)

# Everything but the GPU tests (they need a CUDA device; see bench/gpu). Tests run side by side in
# TEST_SLOTS slots, two a core: each test's PROCESSORS (tests/CMakeLists.txt) is its share, from
# what it was measured to use (most wait on timeouts and processes more than they compute).
TEST_SLOTS ?= $(shell echo $$((2 * $$(nproc))))
test: build
	cd $(BUILD_DIR) && ctest --output-on-failure --label-exclude gpu --timeout 600 -j $(TEST_SLOTS)

# Every libFuzzer target for FUZZ_SECONDS each (clang; `make test` runs them 6 s each).
FUZZ_SECONDS ?= 60
fuzz:
	@for target in $$(tests/fuzz/run.sh --list); do \
	  FLOTILLA_FUZZ_BUILD=$(BUILD_DIR)/fuzz tests/fuzz/run.sh $$target $(FUZZ_SECONDS) || exit 1; \
	done

# Threads per worker: the default against oversubscription (JSON lines; docs/benchmarks.md).
bench-threads: build
	bench/threads.sh

# The input pipeline against tf.data (installs tensorflow-cpu into bench/.venv-tf once).
bench-data: build
	bench/data.sh

# All-reduce bus bandwidth, flotilla's Communicator against raw c10d Gloo, 2 and 3 processes.
bench-allreduce: build
	bench/allreduce.sh

# One CNN pooling layer (ReLU, max-pool 2): flotilla's fused kernel against ATen's, one thread.
bench-max-pool-relu: build
	$(BUILD_DIR)/bench_max_pool_relu | bench/machine.sh --tag

bench-batch-norm-relu: build
	$(BUILD_DIR)/bench_batch_norm_relu | bench/machine.sh --tag

bench-winograd: build
	$(BUILD_DIR)/bench_winograd | bench/machine.sh --tag

# What measuring flotilla's kernels against ATen's costs a run: the first epoch with an empty
# kernel cache against the next run's, which reads it (JSON lines; docs/benchmarks.md).
bench-kernel-choice: build
	bench/kernel_choice.sh

bench-dropout: build
	$(BUILD_DIR)/bench_dropout | bench/machine.sh --tag

bench-attention: build
	$(BUILD_DIR)/bench_attention | bench/machine.sh --tag

# Training samples/s against PyTorch DDP and TF MultiWorkerMirroredStrategy (installs the peers).
bench-peers: build
	bench/peers.sh

# Overlap and compression on 1 Gbit/s links between network namespaces (needs root).
bench-link: build
	bench/link.sh

# `flotilla plan`'s predicted step time against 2- and 3-worker runs over 1 Gbit/s tbf links
# between network namespaces (needs root; exits 77 without it; ~5 minutes).
bench-plan: build
	bench/plan.sh

# What the step profiler costs: 2-worker training with and without --trace (docs/benchmarks.md).
bench-profile: build
	bench/profile.sh

# The recipe's acceptance figures: CNN, 2 workers, batch 256, warmup + cosine, 10 epochs; bf16 speed.
bench-recipe: build
	bench/recipe.sh

bench-batchnorm: build
	bench/batchnorm.sh

# A model scripted in Python (--model PATH) against the same layers from the zoo.
bench-torchscript: build
	bench/torchscript.sh

bench-elastic: build
	bench/elastic.sh

# The control plane at 64, 256 and 1024 simulated members against a real rendezvous: join,
# formation, heal after killing 1%, the rendezvous's memory and CPU (docs/reliability.md).
bench-scale: build
	bench/scale.sh

# One of 2 workers slowed to half its core (a cgroup CPU quota, or a competitor pinned beside
# it): the job's samples/s against the ideal, the sum of each worker's solo speed; then one of
# 3 workers at half the others' quota, and a worker slowed midway (equal shares and auto).
bench-stragglers: build
	bench/stragglers.sh
	bench/stragglers_more.sh

# Elastic training under a fault every 20-40 s for 5 minutes on 4 namespaced hosts (root): with
# the built-in rendezvous (killed and restarted among the faults), then with the rendezvous
# replicated through a real 3-member etcd cluster (an etcd member and the serving replica killed).
bench-chaos: build
	bench/chaos.sh
	RENDEZVOUS=etcd bench/chaos.sh

# Builds and packages the GPU benchmark's binaries into .device/ (bench/gpu/package.sh); the
# benchmark itself runs on the GPU machine (bench/gpu/run.sh; docs/benchmarks.md).
bench-gpu: build
	bench/gpu/package.sh
	@echo "bench-gpu: now, on the GPU machine, from the repository root, with .device carried: OUT=<dir> bench/gpu/run.sh (about 8 minutes; results in <dir>: bench.jsonl, summary.json, machine.txt, gpu_tests.log, run.log)"

# The Debian package of the install tree, LibTorch included: build/package/flotilla_<v>_amd64.deb.
package-deb: build
	cd $(BUILD_DIR) && cpack -G DEB

clean:
	rm -rf $(BUILD_DIR)
