// pdserve transfer-bench: the name docs/architecture.md section 9 lists; the same
// command as `pdserve bench transfer`.
#include "services/cli/command.h"

namespace pdserve::cli {

int RunBenchTransfer(int argc, char** argv);  // cmd_bench_transfer.cpp

PDSERVE_COMMAND("transfer-bench", "same as 'bench transfer'", RunBenchTransfer);

}  // namespace pdserve::cli
