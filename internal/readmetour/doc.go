// Package readmetour checks README.md and the guides of docs/ against the
// code: its tests run every shell command of their sh blocks in order
// (README.md first, then the guides in the order of tourDocs) on a fresh
// database (TestReadmeTour, only with IDEMQ_README_TOUR=1; .ci/run runs it
// after the quickstart), and compile every Go snippet of their go blocks
// (TestReadmeSnippetsCompile). A guide missing from tourDocs fails both.
//
// A block is left out of the tour by an HTML comment on the line before it,
// visible only in the raw Markdown, with the reason:
//
//	<!-- tour: skip (needs Kafka) -->
package readmetour
