// Rendezvous: a small TCP key-value store, like torch's TCPStore. Rank 0 hosts a StoreServer;
// every rank (rank 0 included) talks to it through a Store client. Waits are bounded by a
// timeout and end early when a rank's connection closes without saying goodbye (unless it
// marked itself failed first), so a dead peer gives an error that names it instead of a hang.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rig/core/error.h"

namespace rig::dist {

using Millis = std::chrono::milliseconds;

// A wait on the store ran out of time. `missing` names the keys (or, for join, the ranks) that
// never arrived.
class StoreTimeout : public Error {
 public:
  StoreTimeout(const std::string& what, std::vector<std::string> missing)
      : Error(what), missing(std::move(missing)) {}
  std::vector<std::string> missing;
};

// A peer died while we waited (its connection to the store closed without a goodbye), or the
// store itself is gone (then `ranks` is {0}, the rank hosting it). A rank that marked itself
// failed (see mark_failed) is not a cause and does not end waits.
class PeerGone : public Error {
 public:
  PeerGone(const std::string& what, std::vector<int> ranks) : Error(what), ranks(std::move(ranks)) {}
  std::vector<int> ranks;
};

class StoreServer {
 public:
  // Listens on all interfaces at `port` (0 picks a free one; see port()).
  explicit StoreServer(int port);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const;
  // Waits up to `limit` for every rank's client to disconnect, so the store outlives the ranks
  // that may still need it to learn who failed. Returns how many were still connected.
  int wait_idle(Millis limit);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

class Store {
 public:
  // Connects to host:port, retrying until `timeout` (the server may not be up yet). `rank` >= 0
  // registers this connection as that rank's lifeline; -1 is an anonymous client.
  Store(std::string host, int port, int rank, Millis timeout);
  // Says goodbye, unless mark_failed() was called or an exception is unwinding the stack: then
  // the server counts this rank as gone, and the other ranks' errors name it.
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  int rank() const { return rank_; }
  Millis timeout() const { return timeout_; }
  void set_timeout(Millis t) { timeout_ = t; }
  std::string address() const;  // "host:port"
  const std::string& host() const { return host_; }

  void set(const std::string& key, const std::string& value);
  // Waits up to the timeout for the key to exist.
  std::string get(const std::string& key);
  std::string get(const std::string& key, Millis timeout);
  int64_t add(const std::string& key, int64_t delta);
  bool check(const std::vector<std::string>& keys);
  // Throws StoreTimeout naming the missing keys, or PeerGone.
  void wait(const std::vector<std::string>& keys, Millis timeout);
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

  // Waits until ranks 0..world-1 have all connected; throws StoreTimeout naming the missing ones.
  void join(int world, Millis timeout);
  // All `world` ranks meet here (each call site gets its own round).
  void barrier(int world, const std::string& name = "barrier");
  // The ranks whose connection closed without goodbye and that did not mark themselves failed
  // (the causes), waiting up to `wait` for at least one. Empty if none.
  std::vector<int> dead_ranks(Millis wait);
  // This rank is failing because of someone else: its disconnect is not a root cause.
  void mark_failed();

 private:
  std::vector<std::string> call(uint8_t op, const std::vector<std::string>& args, Millis server_wait,
                                uint8_t* status = nullptr);
  std::string host_;
  int port_;
  int rank_;
  Millis timeout_;
  int fd_ = -1;
  bool failed_ = false;
  uint64_t barrier_round_ = 0;
  std::mutex mu_;
};

// Formats {1, 3} as "ranks 1, 3" and {2} as "rank 2".
std::string ranks_str(const std::vector<int>& ranks);

}  // namespace rig::dist
