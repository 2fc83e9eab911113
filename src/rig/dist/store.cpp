#include "rig/dist/store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <set>
#include <thread>

namespace rig::dist {

namespace {

using Clock = std::chrono::steady_clock;

enum Op : uint8_t { HELLO = 1, SET, GET, ADD, WAIT, CHECK, JOIN, DEAD, FAILED, BYE };
enum Status : uint8_t { OK = 0, TIMEOUT = 1, GONE = 2, BAD = 3 };

// Framing: a request is op, count, then count length-prefixed strings; a reply is status,
// count, strings. Lengths are little-endian u32 (all our hosts are x86/ARM little-endian).
bool write_all(int fd, const void* p, size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= size_t(w);
  }
  return true;
}

// Reads n bytes; deadline of Clock::time_point::max() waits forever.
// Returns 1 on success, 0 on orderly close or error, -1 on timeout.
int read_all(int fd, void* p, size_t n, Clock::time_point deadline) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    int wait_ms = -1;
    if (deadline != Clock::time_point::max()) {
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
      if (left <= 0) return -1;
      wait_ms = int(std::min<int64_t>(left, 1 << 30));
    }
    pollfd pfd{fd, POLLIN, 0};
    int pr = ::poll(&pfd, 1, wait_ms);
    if (pr < 0 && errno == EINTR) continue;
    if (pr < 0) return 0;
    if (pr == 0) return -1;
    ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return 0;
    c += r;
    n -= size_t(r);
  }
  return 1;
}

bool write_msg(int fd, uint8_t head, const std::vector<std::string>& parts) {
  std::string buf;
  buf.push_back(char(head));
  uint32_t n = uint32_t(parts.size());
  buf.append(reinterpret_cast<const char*>(&n), 4);
  for (const auto& s : parts) {
    uint32_t len = uint32_t(s.size());
    buf.append(reinterpret_cast<const char*>(&len), 4);
    buf += s;
  }
  return write_all(fd, buf.data(), buf.size());
}

int read_msg(int fd, uint8_t& head, std::vector<std::string>& parts, Clock::time_point deadline) {
  int r = read_all(fd, &head, 1, deadline);
  if (r != 1) return r;
  uint32_t n = 0;
  if ((r = read_all(fd, &n, 4, deadline)) != 1) return r;
  if (n > (1u << 20)) return 0;
  parts.assign(n, {});
  for (auto& s : parts) {
    uint32_t len = 0;
    if ((r = read_all(fd, &len, 4, deadline)) != 1) return r;
    if (len > (1u << 30)) return 0;
    s.resize(len);
    if (len && (r = read_all(fd, s.data(), len, deadline)) != 1) return r;
  }
  return 1;
}

int64_t to_i64(const std::string& s) { return std::stoll(s); }

}  // namespace

std::string ranks_str(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); i++) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Server: one thread per connection (worlds are small); blocking waits sleep on one condition
// variable that every set, add and death wakes.

struct StoreServer::Impl {
  int listen_fd = -1;
  int port = 0;
  std::thread acceptor;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::map<std::string, std::string> kv;
  std::set<int> joined;
  std::vector<int> dead;        // closed without goodbye, in the order noticed
  std::set<int> failed;         // said they fail because of someone else
  std::vector<int> conns;       // open client sockets
  int live = 0;                 // connected clients that said which rank they are
  std::vector<std::thread> workers;

  void serve(int fd);
  void handle(int fd, int& rank, bool& said_bye, uint8_t op, std::vector<std::string>& a);
  // Ranks gone without goodbye that did not say they fail because of someone else.
  std::vector<int> causes() {
    std::vector<int> out;
    for (int r : dead)
      if (!failed.count(r)) out.push_back(r);
    return out;
  }
};

StoreServer::StoreServer(int port) : impl_(std::make_unique<Impl>()) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail("store: socket(): {}", std::strerror(errno));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(uint16_t(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int e = errno;
    ::close(fd);
    fail("store: cannot listen on port {}: {} (is another run using MASTER_PORT={}?)", port,
         std::strerror(e), port);
  }
  if (::listen(fd, 1024) != 0) {
    int e = errno;
    ::close(fd);
    fail("store: listen(): {}", std::strerror(e));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  impl_->listen_fd = fd;
  impl_->port = ntohs(addr.sin_port);
  Impl* im = impl_.get();
  impl_->acceptor = std::thread([im] {
    for (;;) {
      int c = ::accept4(im->listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      std::lock_guard lk(im->mu);
      if (im->stopping) {
        if (c >= 0) ::close(c);
        return;
      }
      if (c < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE) continue;
        return;
      }
      int one = 1;
      ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      im->conns.push_back(c);
      im->workers.emplace_back([im, c] { im->serve(c); });
    }
  });
}

StoreServer::~StoreServer() {
  {
    std::lock_guard lk(impl_->mu);
    impl_->stopping = true;
    for (int c : impl_->conns) ::shutdown(c, SHUT_RDWR);
  }
  impl_->cv.notify_all();
  ::shutdown(impl_->listen_fd, SHUT_RDWR);  // wakes accept()
  impl_->acceptor.join();
  for (auto& t : impl_->workers) t.join();
  for (int c : impl_->conns) ::close(c);
  ::close(impl_->listen_fd);
}

int StoreServer::port() const { return impl_->port; }

int StoreServer::wait_idle(Millis limit) {
  std::unique_lock lk(impl_->mu);
  impl_->cv.wait_for(lk, limit, [&] { return impl_->live <= 0; });
  return impl_->live;
}

void StoreServer::Impl::serve(int fd) {
  int rank = -1;
  bool said_bye = false;
  for (;;) {
    uint8_t op = 0;
    std::vector<std::string> args;
    if (read_msg(fd, op, args, Clock::time_point::max()) != 1) break;
    try {
      handle(fd, rank, said_bye, op, args);
    } catch (const std::exception& e) {
      write_msg(fd, BAD, {e.what()});
    }
    if (said_bye) break;
  }
  std::lock_guard lk(mu);
  if (rank >= 0) live--;
  if (rank >= 0 && !said_bye && !stopping) dead.push_back(rank);
  cv.notify_all();
}

void StoreServer::Impl::handle(int fd, int& rank, bool& said_bye, uint8_t op,
                               std::vector<std::string>& a) {
  // Long on purpose: one switch, a case per request op.
  auto need = [&](size_t n) {
    if (a.size() < n) fail("store: request {} with {} arguments, expected {}", int(op), a.size(), n);
  };
  std::unique_lock lk(mu);
  auto wait_until = [&](int64_t ms, auto pred) {
    auto deadline = Clock::now() + Millis(ms);
    return cv.wait_until(lk, deadline, [&] { return stopping || pred(); });
  };
  switch (op) {
    case HELLO:
      need(1);
      rank = int(to_i64(a[0]));
      if (rank >= 0) {
        joined.insert(rank);
        live++;
      }
      cv.notify_all();
      lk.unlock();
      write_msg(fd, OK, {});
      return;
    case SET:
      need(2);
      kv[a[0]] = std::move(a[1]);
      cv.notify_all();
      lk.unlock();
      write_msg(fd, OK, {});
      return;
    case ADD: {
      need(2);
      auto& v = kv[a[0]];
      int64_t n = (v.empty() ? 0 : to_i64(v)) + to_i64(a[1]);
      v = std::to_string(n);
      cv.notify_all();
      lk.unlock();
      write_msg(fd, OK, {std::to_string(n)});
      return;
    }
    case CHECK: {
      bool all = std::all_of(a.begin(), a.end(), [&](auto& k) { return kv.count(k) > 0; });
      lk.unlock();
      write_msg(fd, OK, {all ? "1" : "0"});
      return;
    }
    case GET:
    case WAIT: {
      need(1);
      int64_t ms = to_i64(a[0]);
      std::vector<std::string> keys(a.begin() + 1, a.end());
      auto have_all = [&] {
        return std::all_of(keys.begin(), keys.end(), [&](auto& k) { return kv.count(k) > 0; });
      };
      wait_until(ms, [&] { return have_all() || !causes().empty(); });
      if (have_all()) {
        std::vector<std::string> out;
        if (op == GET)
          for (auto& k : keys) out.push_back(kv[k]);
        lk.unlock();
        write_msg(fd, OK, out);
      } else if (!causes().empty()) {
        std::vector<std::string> out;
        for (int r : causes()) out.push_back(std::to_string(r));
        lk.unlock();
        write_msg(fd, GONE, out);
      } else {
        std::vector<std::string> missing;
        for (auto& k : keys)
          if (!kv.count(k)) missing.push_back(k);
        lk.unlock();
        write_msg(fd, TIMEOUT, missing);
      }
      return;
    }
    case JOIN: {
      need(2);
      int world = int(to_i64(a[0]));
      auto all_in = [&] {
        for (int r = 0; r < world; r++)
          if (!joined.count(r)) return false;
        return true;
      };
      wait_until(to_i64(a[1]), [&] { return all_in() || !causes().empty(); });
      std::vector<std::string> out;
      uint8_t st = OK;
      if (!all_in()) {
        st = causes().empty() ? TIMEOUT : GONE;
        if (st == GONE)
          for (int r : causes()) out.push_back(std::to_string(r));
        else
          for (int r = 0; r < world; r++)
            if (!joined.count(r)) out.push_back(std::to_string(r));
      }
      lk.unlock();
      write_msg(fd, st, out);
      return;
    }
    case DEAD: {
      need(1);
      wait_until(to_i64(a[0]), [&] { return !causes().empty(); });
      std::vector<std::string> out;
      for (int r : causes()) out.push_back(std::to_string(r));
      lk.unlock();
      write_msg(fd, OK, out);
      return;
    }
    case FAILED:
      if (rank >= 0) failed.insert(rank);
      lk.unlock();
      write_msg(fd, OK, {});
      return;
    case BYE:
      said_bye = true;
      lk.unlock();
      write_msg(fd, OK, {});
      return;
    default:
      lk.unlock();
      write_msg(fd, BAD, {fmt::format("unknown request {}", int(op))});
  }
}

// ---------------------------------------------------------------------------------------------
// Client

namespace {

int connect_once(const std::string& host, int port, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int g = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (g != 0) {
    why = fmt::format("cannot resolve '{}': {}", host, gai_strerror(g));
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) break;
    why = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd >= 0) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}

}  // namespace

Store::Store(std::string host, int port, int rank, Millis timeout)
    : host_(std::move(host)), port_(port), rank_(rank), timeout_(timeout) {
  auto deadline = Clock::now() + timeout;
  std::string why = "no attempt";
  auto pause = Millis(10);
  for (;;) {
    fd_ = connect_once(host_, port_, why);
    if (fd_ >= 0) break;
    if (Clock::now() + pause > deadline)
      throw PeerGone(fmt::format("could not reach the rendezvous store on rank 0 at {} within {} ms: {}",
                                 address(), timeout.count(), why),
                     {0});
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, Millis(500));
  }
  call(HELLO, {std::to_string(rank_)}, Millis(0));
}

Store::~Store() {
  if (fd_ < 0) return;
  if (!failed_ && std::uncaught_exceptions() == 0) {
    try {
      call(BYE, {}, Millis(0));
    } catch (...) {
    }
  }
  ::close(fd_);
}

std::string Store::address() const { return fmt::format("{}:{}", host_, port_); }

std::vector<std::string> Store::call(uint8_t op, const std::vector<std::string>& args,
                                     Millis server_wait, uint8_t* status) {
  std::lock_guard lk(mu_);
  auto gone = [&](const char* what) {
    return PeerGone(fmt::format("rank 0 exited: lost the rendezvous store it hosts at {} ({})", address(), what),
                    {0});
  };
  if (fd_ < 0) throw gone("not connected");
  if (!write_msg(fd_, op, args)) throw gone(std::strerror(errno));
  // The server answers a wait by its own deadline; allow it a margin before calling it hung.
  auto deadline = Clock::now() + server_wait + std::max(timeout_, Millis(5000));
  uint8_t st = 0;
  std::vector<std::string> out;
  int r = read_msg(fd_, st, out, deadline);
  if (r == 0) throw gone("connection closed");
  if (r < 0) throw gone("no answer (rank 0 hung?)");
  if (st == BAD) fail("store at {}: {}", address(), out.empty() ? "bad request" : out[0]);
  if (status) *status = st;
  else if (st != OK) fail("store at {}: unexpected status {}", address(), int(st));
  return out;
}

namespace {
std::vector<int> parse_ranks(const std::vector<std::string>& v) {
  std::vector<int> r;
  for (auto& s : v) r.push_back(int(to_i64(s)));
  return r;
}
std::string join_keys(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); i++) s += (i ? ", '" : "'") + v[i] + "'";
  return s;
}
}  // namespace

void Store::set(const std::string& key, const std::string& value) { call(SET, {key, value}, Millis(0)); }

std::string Store::get(const std::string& key) { return get(key, timeout_); }

std::string Store::get(const std::string& key, Millis timeout) {
  uint8_t st = 0;
  auto out = call(GET, {std::to_string(timeout.count()), key}, timeout, &st);
  if (st == OK && out.size() == 1) return out[0];
  if (st == GONE)
    throw PeerGone(fmt::format("{} exited or lost its connection while waiting for key '{}'",
                               ranks_str(parse_ranks(out)), key),
                   parse_ranks(out));
  throw StoreTimeout(fmt::format("timed out after {} ms waiting for key '{}' in the store at {}",
                                 timeout.count(), key, address()),
                     {key});
}

int64_t Store::add(const std::string& key, int64_t delta) {
  auto out = call(ADD, {key, std::to_string(delta)}, Millis(0));
  return to_i64(out.at(0));
}

bool Store::check(const std::vector<std::string>& keys) { return call(CHECK, keys, Millis(0)).at(0) == "1"; }

void Store::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::string> args{std::to_string(timeout.count())};
  args.insert(args.end(), keys.begin(), keys.end());
  uint8_t st = 0;
  auto out = call(WAIT, args, timeout, &st);
  if (st == OK) return;
  if (st == GONE)
    throw PeerGone(fmt::format("{} exited or lost its connection while waiting for {}",
                               ranks_str(parse_ranks(out)), join_keys(keys)),
                   parse_ranks(out));
  throw StoreTimeout(fmt::format("timed out after {} ms waiting for {} in the store at {}",
                                 timeout.count(), join_keys(out), address()),
                     out);
}

void Store::join(int world, Millis timeout) {
  uint8_t st = 0;
  auto out = call(JOIN, {std::to_string(world), std::to_string(timeout.count())}, timeout, &st);
  if (st == OK) return;
  if (st == GONE)
    throw PeerGone(fmt::format("{} exited or lost its connection before all {} ranks joined",
                               ranks_str(parse_ranks(out)), world),
                   parse_ranks(out));
  throw StoreTimeout(fmt::format("{} did not connect to the rendezvous store at {} within {} ms",
                                 ranks_str(parse_ranks(out)), address(), timeout.count()),
                     out);
}

void Store::barrier(int world, const std::string& name) {
  std::string key = fmt::format("rig/barrier/{}/{}", name, barrier_round_++);
  if (add(key, 1) == world) set(key + "/done", "");
  try {
    wait({key + "/done"});
  } catch (const StoreTimeout&) {
    int64_t arrived = add(key, 0);
    throw StoreTimeout(fmt::format("barrier '{}': only {} of {} ranks arrived within {} ms", name,
                                   arrived, world, timeout_.count()),
                       {key});
  }
}

std::vector<int> Store::dead_ranks(Millis wait) {
  return parse_ranks(call(DEAD, {std::to_string(wait.count())}, wait));
}

void Store::mark_failed() {
  failed_ = true;
  call(FAILED, {}, Millis(0));
}

}  // namespace rig::dist
