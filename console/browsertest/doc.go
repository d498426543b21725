// Package browsertest drives the console (package console) in a real browser, headless
// Chromium: an operator's path through the page over a real router on the embedded default,
// checked against the database. It is a module of its own so that the library's go.mod does
// not carry the browser driver.
//
// Under CI=true the test fails when Chromium is missing; otherwise it skips, naming the Debian
// package to install (chromium). ONCEFLOW_TEST_CHROMIUM names another browser binary.
// ONCEFLOW_SCREENSHOTS=1 makes the test write its screenshots to docs/console/, which
// docs/console.md shows; without it they go to a temporary directory and the tree stays clean.
package browsertest
