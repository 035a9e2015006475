// The drivers' inputs and outputs: raw little-endian arrays in one directory, written by
// the Rust tests (kernels/tests/cuda_host_emulation.rs) and read back by them.

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace files {
inline std::string dir;

// DIR/name as T values; empty where the file is missing.
template <class T>
std::vector<T> read(const std::string& name) {
    std::string path = dir + "/" + name;
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) return {};
    std::vector<T> v;
    T x;
    while (std::fread(&x, sizeof(T), 1, f) == 1) v.push_back(x);
    std::fclose(f);
    return v;
}

template <class T>
void write(const std::string& name, const std::vector<T>& v) {
    std::string path = dir + "/" + name;
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) {
        std::fprintf(stderr, "cannot write %s\n", path.c_str());
        std::exit(2);
    }
    std::fclose(f);
}
}  // namespace files

using files::read;
using files::write;
