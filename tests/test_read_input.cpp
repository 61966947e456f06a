// read_input: the whole input up to a size limit, with errors that name the input.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "locks/text_corpus.h"

namespace {

std::string temp_file(const std::string& name, const std::string& content) {
  const auto p = std::filesystem::temp_directory_path() / name;
  std::ofstream(p, std::ios::binary) << content;
  return p.string();
}

std::string error_of(const std::string& path, size_t max_bytes) {
  try {
    locks::read_input(path, max_bytes, "prompt file");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ReadInput, ReturnsTheWholeFileUpToTheLimit) {
  std::string content(200000, 'x');  // several 64 KiB reads
  content[123456] = '\0';            // binary-safe
  const std::string p = temp_file("locks_read_input_ok.txt", content);
  EXPECT_EQ(locks::read_input(p, content.size(), "prompt file"), content);  // exactly at the limit
  std::remove(p.c_str());
}

TEST(ReadInput, LargerThanTheLimitNamesTheInput) {
  const std::string p = temp_file("locks_read_input_big.txt", std::string((2 << 20) + 1, 'y'));
  EXPECT_NE(error_of(p, size_t(2) << 20).find("prompt file '" + p + "' is larger than 2 MiB"), std::string::npos);
  std::remove(p.c_str());
  // An endless source stops at the limit.
  EXPECT_NE(error_of("/dev/zero", size_t(1) << 20).find("is larger than 1 MiB"), std::string::npos);
}

TEST(ReadInput, MissingFileAndDirectoryAreNamed) {
  EXPECT_EQ(error_of("/nonexistent/locks-prompt.txt", 1 << 20),
            "cannot open prompt file '/nonexistent/locks-prompt.txt': No such file or directory");
  const std::string dir = std::filesystem::temp_directory_path().string();
  EXPECT_EQ(error_of(dir, 1 << 20), "prompt file '" + dir + "' is a directory");
}

TEST(ReadInput, RequireTextRefusesANulByteAtItsOffset) {
  EXPECT_NO_THROW(locks::require_text("plain text\n", "p.txt", "prompt file"));
  EXPECT_NO_THROW(locks::require_text("", "p.txt", "prompt file"));
  try {
    locks::require_text(std::string("ab\0c\0", 5), "-", "prompt file");
    ADD_FAILURE() << "a NUL byte must be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "prompt file (standard input) holds a NUL byte at offset 2 (binary data, not text)");
  }
  try {
    locks::require_text(std::string(7, '\0'), "c.txt", "text corpus");
    ADD_FAILURE() << "a NUL byte must be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "text corpus 'c.txt' holds a NUL byte at offset 0 (binary data, not text)");
  }
}
