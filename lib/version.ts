/** dispatch-cloud's version (package.json "version"; a unit test keeps the two equal). */
export const VERSION = "0.1.0";
