#include "transport/control/detail/byte_stream.h"

#include <boost/asio/ssl.hpp>

#include "transport/control/detail/tls_impl.h"

namespace pdserve::control::detail {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

class PlainStream final : public ByteStream {
 public:
  explicit PlainStream(tcp::socket socket) : socket_(std::move(socket)) {}
  asio::any_io_executor executor() override { return socket_.get_executor(); }
  void AsyncHandshake(HandshakeSide,
                      std::function<void(const boost::system::error_code&)> done) override {
    asio::post(socket_.get_executor(), [done = std::move(done)] { done({}); });
  }
  void AsyncReadSome(asio::mutable_buffer buffer, Handler done) override {
    socket_.async_read_some(buffer, std::move(done));
  }
  void AsyncWrite(std::vector<asio::const_buffer> buffers, Handler done) override {
    asio::async_write(socket_, std::move(buffers), std::move(done));
  }
  void Close() override {
    boost::system::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

 private:
  tcp::socket socket_;
};

class TlsStream final : public ByteStream {
 public:
  TlsStream(tcp::socket socket, std::shared_ptr<TlsContext::Impl> context)
      : context_(std::move(context)), stream_(std::move(socket), context_->context) {}
  asio::any_io_executor executor() override { return stream_.get_executor(); }
  void AsyncHandshake(HandshakeSide side,
                      std::function<void(const boost::system::error_code&)> done) override {
    stream_.async_handshake(side == HandshakeSide::kInitiator ? asio::ssl::stream_base::client
                                                              : asio::ssl::stream_base::server,
                            std::move(done));
  }
  void AsyncReadSome(asio::mutable_buffer buffer, Handler done) override {
    stream_.async_read_some(buffer, std::move(done));
  }
  void AsyncWrite(std::vector<asio::const_buffer> buffers, Handler done) override {
    asio::async_write(stream_, std::move(buffers), std::move(done));
  }
  void Close() override {
    // No close_notify exchange: the control protocol ends with Goodbye, and a
    // peer that stopped reading must not delay the close.
    boost::system::error_code ignored;
    stream_.lowest_layer().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.lowest_layer().close(ignored);
  }

 private:
  std::shared_ptr<TlsContext::Impl> context_;  // outlives stream_, which refers to it
  asio::ssl::stream<tcp::socket> stream_;
};

}  // namespace

std::unique_ptr<ByteStream> MakeByteStream(tcp::socket socket, const TlsContext* tls) {
  if (tls == nullptr) return std::make_unique<PlainStream>(std::move(socket));
  return std::make_unique<TlsStream>(std::move(socket), tls->Current());
}

}  // namespace pdserve::control::detail
