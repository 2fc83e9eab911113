// A completion handle shared by the backends, and a single worker thread that runs collectives
// in the order they were issued (the order every rank must agree on).
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "rig/dist/communicator.h"

namespace rig::dist {

class FutureWork : public Work {
 public:
  void wait() override {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool done() override {
    std::lock_guard lk(mu_);
    return done_;
  }
  void finish(std::exception_ptr e = nullptr) {
    {
      std::lock_guard lk(mu_);
      done_ = true;
      error_ = e;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class WorkQueue {
 public:
  WorkQueue() : thread_([this] { loop(); }) {}
  ~WorkQueue() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Runs fn on the worker thread; its exception (if any) goes to the returned Work.
  std::shared_ptr<FutureWork> submit(std::function<void()> fn) {
    auto w = std::make_shared<FutureWork>();
    {
      std::lock_guard lk(mu_);
      q_.emplace_back(std::move(fn), w);
    }
    cv_.notify_all();
    return w;
  }

 private:
  void loop() {
    for (;;) {
      std::pair<std::function<void()>, std::shared_ptr<FutureWork>> item;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;  // stop_ and drained
        item = std::move(q_.front());
        q_.pop_front();
      }
      try {
        item.first();
        item.second->finish();
      } catch (...) {
        item.second->finish(std::current_exception());
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<FutureWork>>> q_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace rig::dist
