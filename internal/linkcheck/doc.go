// Package linkcheck holds no code: its tests check what programs link. A program that imports
// the root package, processor and one database driver links no other driver and no broker
// client; a RabbitMQ program links no other broker; the core packages link neither; and a URL
// whose driver or scheme is not imported fails with an error that names the import. The
// programs are in testdata; docs/performance.md gives their sizes.
package linkcheck
