// The launcher with real processes: flags, workers that are killed, fail, hang, or never come.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "rig/dist/launcher.h"
#include "test_util.h"

using namespace rig;
using namespace rig::dist;
using namespace std::chrono_literals;

// ---- launcher -----------------------------------------------------------------------------

TEST(DistLaunch, FlagsAreStrippedForWorkers) {
  std::vector<std::string> in{"rig",      "train",      "c.yaml",      "--nproc-per-node",
                              "4",        "--nnodes=2", "--node-rank", "1",
                              "--master", "h:1",        "--lr",        "3"};
  EXPECT_EQ(strip_launch_flags(in),
            (std::vector<std::string>{"rig", "train", "c.yaml", "--lr", "3"}));
  LaunchOptions o;
  parse_master("node01:29400", o);
  EXPECT_EQ(o.master_addr, "node01");
  EXPECT_EQ(o.master_port, 29400);
  EXPECT_THROW(parse_master("node01", o), InputError);
  EXPECT_THROW(parse_master("node01:x", o), InputError);
  LaunchOptions none;
  none.nproc_per_node = 0;
  EXPECT_THROW(launch_local(none, {"true"}), InputError);
}

TEST(DistLaunch, FourWorkersAllReduce) {
  auto r = test::run_rig("debug allreduce-check --nproc-per-node 4 --numel 10000");
  EXPECT_EQ(r.code, 0) << r.out;
  for (int k = 0; k < 4; k++)
    EXPECT_NE(r.out.find(fmt::format("rank {} of 4: all-reduce check passed", k)),
              std::string::npos)
        << r.out;
}

TEST(DistLaunch, KilledWorkerIsNamedByTheOthers) {
  // The others learn of the death from the store ("rank 1 exited", below), not from their
  // collective timeout: that is 2 minutes, so the message alone shows it, with no clock read.
  auto r = test::run_rig(
      "debug allreduce-check --nproc-per-node 3 --numel 10000 --fail-rank 1 --fail-mode kill "
      "--timeout-ms 120000");
  EXPECT_EQ(r.code, 128 + 9) << r.out;
  EXPECT_NE(r.out.find("rig launch: rank 1 (pid"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("was killed by signal 9"), std::string::npos) << r.out;
  for (int k : {0, 2})
    EXPECT_NE(r.out.find(fmt::format(
                  "rank {}: Gloo all_reduce #1 (10000 floats) failed: rank 1 exited", k)),
              std::string::npos)
        << r.out;
}

TEST(DistLaunch, WorkerThatFailsEarlyIsNamed) {
  auto r = test::run_rig(
      "debug allreduce-check --nproc-per-node 4 --fail-rank 2 --fail-mode exit --timeout-ms 20000");
  EXPECT_EQ(r.code, 1) << r.out;
  // (Which exit the launcher sees first is a race; the summary lists every failed rank.)
  EXPECT_NE(r.out.find("rig launch:   rank 2 exited with code 1"), std::string::npos) << r.out;
  for (int k : {0, 1, 3})
    EXPECT_NE(r.out.find(fmt::format("rank {}: Gloo all_reduce #1", k)), std::string::npos)
        << r.out;
  EXPECT_EQ(r.out.find("rank 3 exited or lost"), std::string::npos)
      << r.out;  // only the cause is blamed
  EXPECT_NE(r.out.find("rank 2 exited or lost its connection"), std::string::npos) << r.out;
}

TEST(DistLaunch, HungWorkerIsNamedAfterTheTimeout) {
  // The hung rank sleeps for an hour: that the run ends at all is the launcher stopping it.
  auto r = test::run_rig(
      "debug allreduce-check --nproc-per-node 3 --numel 10000 --fail-rank 1 --fail-mode hang "
      "--timeout-ms 1500 "
      "--launch-grace-ms 6000");  // rank 0 keeps the store up to 5 s for the others
  EXPECT_NE(r.code, 0) << r.out;
  for (int k : {0, 2})
    EXPECT_NE(
        r.out.find(fmt::format(
            "rank {}: Gloo all_reduce #1 (10000 floats) failed: rank 1 did not take part", k)),
        std::string::npos)
        << r.out;
  EXPECT_NE(r.out.find("sending SIGTERM"), std::string::npos) << r.out;  // the hung one is stopped
}

TEST(DistLaunch, SigtermIsForwardedToWorkers) {
  std::string dir = test::temp_dir("dist-sigterm");
  // Rank 0 hangs at its second all-reduce and rank 1 waits in it (a 10-minute timeout): once
  // rank 0 says so, both workers run, and the launcher gets SIGTERM then, not after a fixed time.
  const pid_t pid = test::spawn_rig(
      "debug allreduce-check --nproc-per-node 2 --fail-rank 0 --fail-mode hang --timeout-ms 600000",
      dir + "/out");
  ASSERT_GT(pid, 0);
  const bool hanging = test::wait_for_text(dir + "/out", "rank 0: failing on purpose (hang)", 300);
  kill(pid, SIGTERM);
  // Forwarded, the workers end at once; not forwarded, the launcher would wait out the timeout.
  const int code = test::wait_exit_within(pid, 300);
  const std::string text = test::file_text(dir + "/out");
  ASSERT_TRUE(hanging) << text;
  EXPECT_EQ(code, 128 + 15) << text;
  EXPECT_NE(text.find("passing it to 2 workers"), std::string::npos) << text;
}

TEST(DistLaunch, MissingRankIsNamedAtRendezvous) {
  // World of 2 but only rank 0 starts: the rendezvous names rank 1 within the timeout.
  auto r = test::run_rig("debug allreduce-check --timeout-ms 500");  // world of 1 works alone
  EXPECT_EQ(r.code, 0) << r.out;
  int port = free_port();
  std::string cmd = fmt::format(
      "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} {} debug allreduce-check "
      "--timeout-ms 500 2>&1",
      port, RIG_BINARY);
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_TRUE(p);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) text.append(buf, n);
  int st = pclose(p);
  EXPECT_NE(WEXITSTATUS(st), 0) << text;
  EXPECT_NE(text.find("rank 1 did not connect to the rendezvous store"), std::string::npos) << text;
}
