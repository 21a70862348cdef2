//! qkp, the stage transport: a pure frame codec, the hello, and the connection code.
