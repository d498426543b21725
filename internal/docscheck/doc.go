// Package docscheck holds tests that keep the README and the docs true to the code: every Go
// block of the pages is an excerpt of a Go file that the build compiles (an example, a runnable
// Example, a test), the README's one-screen program is the example its tests run, every
// relative link names a file and every #anchor a heading, and the README's commands name
// targets and paths that exist.
package docscheck
