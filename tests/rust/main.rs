//! The one cargo integration-test binary; each area adds a module here.
mod ops_tests;
