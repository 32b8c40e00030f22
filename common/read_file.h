// Reading a small file whole (configs, templates, schemas, key lists): one
// place that refuses what is not a regular file before opening it, since a
// directory makes the stream read throw and a FIFO makes the open block.
#pragma once

#include <string>

#include "common/status.h"

namespace pdserve {

// `path`'s whole contents (empty for an empty file). kNotFound when nothing
// is there, kInvalidArgument when it is not a regular file, kUnavailable
// when it cannot be read; each message starts with the path.
StatusOr<std::string> ReadRegularFile(const std::string& path);

}  // namespace pdserve
