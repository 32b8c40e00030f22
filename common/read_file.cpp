#include "common/read_file.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace pdserve {

StatusOr<std::string> ReadRegularFile(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) return Status::NotFound(path + ": cannot open (no such file)");
  if (!fs::is_regular_file(st)) return Status::InvalidArgument(path + ": not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::Unavailable(path + ": cannot open");
  std::ostringstream text;
  // Inserting no character (an empty file) sets failbit: not an error.
  if (in.peek() != std::ifstream::traits_type::eof() && !(text << in.rdbuf())) {
    return Status::Unavailable(path + ": cannot read");
  }
  return text.str();
}

}  // namespace pdserve
