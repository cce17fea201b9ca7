// Private: the factories of the backends a Communicator drives. Only src/collective/gloo and
// src/collective/nccl include the backends' own headers; a backend not built has a stub that
// throws, so callers need no #ifdef.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <exception>
#include <string>

namespace flotilla::collective::detail {

// Gloo's TCP transport, bound to `local_host` ("" lets Gloo resolve this host's name).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    const std::string& local_host,
                                                    std::chrono::milliseconds timeout);

// Resets every connection of a backend make_gloo_backend made (nothing for another backend):
// its peers' operations on them fail at once, and its own pending ones later (they were
// abandoned). Safe while its threads run.
void close_gloo_connections(c10d::Backend& backend);

// Whether `e` is one of Gloo's transport errors (gloo::IoException): what ProcessGroupGloo's
// work rethrows, unwrapped, for a timeout and for a closed or failed connection alike.
bool is_gloo_transport_error(const std::exception& e);

bool nccl_built();
// NCCL on the current CUDA device; throws ConfigError where NCCL is not built.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);

// Within one process, across its CUDA devices (torch::cuda::nccl, as DataParallel uses):
// false, doing nothing, where NCCL is not built or the tensors do not qualify.
bool nccl_local_reduce(const std::vector<at::Tensor>& tensors);
bool nccl_local_broadcast(const std::vector<at::Tensor>& tensors);
bool nccl_local_usable(const std::vector<at::Tensor>& tensors);

} // namespace flotilla::collective::detail
