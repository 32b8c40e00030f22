// The Asio SSL context behind TlsContext; only the connection layer needs it.
#pragma once

#include <boost/asio/ssl/context.hpp>

#include "transport/control/tls.h"

namespace pdserve::control {

struct TlsContext::Impl {
  // Streams take the context by reference and only read it after setup.
  boost::asio::ssl::context context{boost::asio::ssl::context::tls};
};

}  // namespace pdserve::control
