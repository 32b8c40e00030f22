// The bytes under a control connection: plain TCP or TLS over TCP, behind one
// interface so that the connection logic is written once.
//
// Contract: every call is made on the stream's executor (the connection's
// strand) and every handler runs there; at most one read and one write are
// outstanding at a time. Close() ends the socket: pending operations complete
// with an error.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include <utility>

#include <boost/asio.hpp>

#include "transport/control/handshake.h"
#include "transport/control/tls.h"

namespace pdserve::control::detail {

class ByteStream {
 public:
  using Handler = std::function<void(const boost::system::error_code&, size_t)>;
  virtual ~ByteStream() = default;

  virtual boost::asio::any_io_executor executor() = 0;
  // TLS: the TLS handshake as `side`; plain TCP: completes at once (posted).
  virtual void AsyncHandshake(HandshakeSide side,
                              std::function<void(const boost::system::error_code&)> done) = 0;
  virtual void AsyncReadSome(boost::asio::mutable_buffer buffer, Handler done) = 0;
  virtual void AsyncWrite(std::vector<boost::asio::const_buffer> buffers, Handler done) = 0;
  virtual void Close() = 0;
};

// `tls` null: plain TCP.
std::unique_ptr<ByteStream> MakeByteStream(boost::asio::ip::tcp::socket socket,
                                           const TlsContext* tls);

}  // namespace pdserve::control::detail
