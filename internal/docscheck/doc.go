// Package docscheck holds tests that keep the README and the docs true to the code: the
// program the README shows is the one under examples/ that its tests run.
package docscheck
